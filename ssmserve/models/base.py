"""What every model gives the engine: forward over a ForwardBatch, logits, and its caches."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch


class CausalLM(nn.Module):
    """Base of all model classes. Subclasses build modules named as in the HF checkpoint
    (so loading is a name-for-name copy) and implement `embed`, `backbone` and `final_norm`.
    """

    # Checkpoint tensors that are not parameters (e.g. cached RoPE tables).
    ignored_checkpoint_keys: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))

    # -- subclass interface ---------------------------------------------------------

    def input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    def decoder_layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the batch."""
        hidden = self.input_embeddings()(batch.input_ids)
        for layer in self.decoder_layers():
            hidden = layer(hidden, batch)
        return self.final_norm()(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def tie_weights_if_needed(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.input_embeddings().weight

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def ssm_layers(self) -> list[nn.Module]:
        return [m for m in self.modules() if hasattr(m, "ssm_state")]

    def cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return sum(a.cache_bytes_per_block(block_size, dtype) for a in self.attention_layers())

    def cache_bytes_per_slot(self, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        return sum(m.cache_bytes_per_slot(dtype, state_dtype) for m in self.ssm_layers())

    def allocate_caches(
        self,
        *,
        num_kv_blocks: int,
        block_size: int,
        num_state_slots: int,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        for attn in self.attention_layers():
            attn.allocate_cache(num_kv_blocks, block_size, dtype, device)
        for mixer in self.ssm_layers():
            mixer.allocate_cache(num_state_slots, dtype, state_dtype, device)

    def release_caches(self) -> None:
        for attn in self.attention_layers():
            attn.k_cache = attn.v_cache = None
        for mixer in self.ssm_layers():
            mixer.conv_state = mixer.ssm_state = None
