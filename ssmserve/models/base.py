"""What every model gives the engine: forward over a ForwardBatch and its caches, logits,
cache specs, and how checkpoint names map onto its parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import KernelOps
from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import ParallelLMHead, VocabParallelEmbedding
from ssmserve.layers.mamba2_mixer import Mamba2Mixer
from ssmserve.layers.norm import RMSNorm
from ssmserve.layers.rotary import RotaryEmbedding

# (checkpoint name fragment, module name fragment, shard id): a checkpoint tensor whose
# name contains the fragment loads into the fused parameter as that shard.
NameRule = tuple[str, str, int | None]

QKV_RULES: tuple[NameRule, ...] = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
)
GATE_UP_RULES: tuple[NameRule, ...] = (
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x * multiplier, skipped (no kernel) when the multiplier is 1, as it is once folded
    into the weights (`CausalLM.fold_constants`)."""
    return x if multiplier == 1.0 else x * multiplier


class PreNormBlock(nn.Module):
    """A decoder block that starts with an RMSNorm of its input and ends by adding its
    last branch's output to the residual stream: `forward(h)` is `h' + out` for
    `(out, h') = forward_residual(pre_norm()(h), h, ...)`. `CausalLM.run_layers` leaves
    that last add to the next block's norm, or the final norm (`RMSNorm.add_forward`: one
    kernel for the add and the norm, rounded as the add followed by the norm)."""

    def pre_norm(self) -> nn.Module:
        """The norm the block starts with: `input_layernorm` unless the family names it
        otherwise."""
        return self.input_layernorm

    def forward_residual(
        self, x: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: pre_norm(hidden). Returns (the last branch's output, the residual stream
        before it is added)."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        out, hidden = self.forward_residual(self.pre_norm()(hidden), hidden, batch, cache)
        return hidden + out


@dataclass(frozen=True)
class PipelineStage:
    """The contiguous decoder layers one pipeline stage runs; the first stage embeds the
    tokens, the last applies the final norm and the LM head."""

    layers: range
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(range(num_layers))


@dataclass(frozen=True)
class ModelContext:
    """What layers are built with: the kernels, this rank's tensor-parallel group and,
    under pipeline parallelism, its stage (None: the whole model)."""

    ops: KernelOps
    tp: TensorParallel
    stage: PipelineStage | None = None


class CausalLM(nn.Module):
    """Base of all model classes: embeddings, decoder blocks walked in order, a final
    norm and a vocab-parallel LM head.

    A family builds its modules named as in the HF checkpoint where it can, lists in
    `name_rules` the checkpoint names that load into fused parameters, and implements
    `input_embeddings`, `decoder_layers` and `final_norm`. Each decoder block takes
    `(hidden, batch, cache)` and has `cache_spec()`: block i gets the engine's cache i.
    """

    name_rules: tuple[NameRule, ...] = ()
    # Checkpoint tensors that are not parameters (e.g. cached RoPE tables).
    ignored_checkpoint_keys: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.ctx = ctx
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))

    # -- subclass interface ---------------------------------------------------------

    def input_embeddings(self) -> VocabParallelEmbedding:
        raise NotImplementedError

    def decoder_layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def final_norm(self) -> nn.Module:
        raise NotImplementedError

    def fold_constants(self) -> None:
        """Fold constant scales into the loaded weights, once, after loading (or dummy
        init): a family with multipliers on linear outputs (Falcon-H1's µP, Granite's
        residual multiplier) saves the elementwise kernels they would cost in every step.
        Each of this stage's decoder layers with a `fold_multipliers()` folds its own."""
        layers = self.decoder_layers()
        for i in self.stage.layers:
            fold = getattr(layers[i], "fold_multipliers", None)
            if fold is not None:
                fold()

    # -- shared --------------------------------------------------------------------

    def make_lm_head(self, vocab_size: int, hidden_size: int) -> ParallelLMHead:
        tied = self.input_embeddings() if self.tie_word_embeddings else None
        return ParallelLMHead(vocab_size, hidden_size, self.ctx.tp, tied)

    @property
    def stage(self) -> PipelineStage:
        return self.ctx.stage or PipelineStage.whole(len(self.decoder_layers()))

    def forward(
        self,
        batch: ForwardBatch,
        caches: list[LayerCache],
        received: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """This stage's part of the forward. The whole model (and the last stage) returns
        hidden states [T, hidden] after the final norm; an earlier stage returns what the
        next one needs (`intermediate_spec`). `received`: what the previous stage sent."""
        stage = self.stage
        hidden = self.embed(batch) if received is None else received["hidden"]
        hidden, out = self.run_layers(hidden, batch, caches)
        if not stage.is_last:
            return {"hidden": hidden if out is None else hidden + out}
        if out is None:
            return self.final_norm()(hidden)
        return self.final_add_norm(out, hidden)

    def embed(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The first stage's input to `run_layers`: the tokens' embeddings, or None where
        the first block's norm gathers them itself (`embeds_in_first_norm`)."""
        if self.embeds_in_first_norm():
            return None
        return self.input_embeddings()(batch.input_ids)

    def embeds_in_first_norm(self) -> bool:
        """Whether the first block's norm gathers the tokens' embedding rows in its own
        launch (`embed_rms_norm`: one kernel, not the embedding's and the norm's): on one
        rank (a vocab-parallel embedding sums its ranks' rows first), the first stage,
        a plain embedding (Granite's and Falcon-H1's scale theirs) and a PreNormBlock
        whose norm is the kernel RMSNorm in the table's dtype."""
        if self.ctx.tp.size != 1 or not self.stage.is_first or not self.stage.layers:
            return False
        embedding = self.input_embeddings()
        first = self.decoder_layers()[self.stage.layers[0]]
        if type(embedding) is not VocabParallelEmbedding or not isinstance(first, PreNormBlock):
            return False
        norm = first.pre_norm()
        return (
            isinstance(norm, RMSNorm)
            and norm.ops is not None
            and norm.weight.dtype == embedding.weight.dtype
        )

    def final_add_norm(self, out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm of hidden + out (the last block's output, not yet added): one
        kernel for the add and the norm, as between blocks."""
        return self.final_norm().add_forward(out, hidden)[0]

    def run_layers(
        self, hidden: torch.Tensor | None, batch: ForwardBatch, caches: list[LayerCache]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's decoder blocks over `hidden` (None: the tokens, embedded by the
        first block's norm, `embeds_in_first_norm`), in order: (the residual stream, the
        last block's output not yet added to it, or None). A PreNormBlock's last residual
        add is fused into the next PreNormBlock's norm, the last block's into the final
        norm (`forward`)."""
        layers = self.decoder_layers()
        out = None  # the last block's branch output, not yet added to `hidden`
        for i in self.stage.layers:
            layer = layers[i]
            if not isinstance(layer, PreNormBlock):
                if out is not None:
                    hidden, out = hidden + out, None
                hidden = layer(hidden, batch, caches[i])
                continue
            if hidden is None:  # `embed` left the gather to the first norm
                norm, table = layer.pre_norm(), self.input_embeddings().weight
                x, hidden = self.ctx.ops.embed_rms_norm(
                    batch.input_ids, table, norm.weight, eps=norm.eps, sum_dtype=table.dtype
                )
            elif out is None:
                x = layer.pre_norm()(hidden)
            else:
                x, hidden = layer.pre_norm().add_forward(out, hidden)
            out, hidden = layer.forward_residual(x, hidden, batch, caches[i])
        return hidden, out

    def intermediate_spec(self, num_tokens: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of what a stage sends the next one."""
        return {"hidden": ((num_tokens, self.hf_config.hidden_size), self.residual_dtype)}

    @property
    def residual_dtype(self) -> torch.dtype:
        """The dtype of the hidden state between decoder layers."""
        return self.lm_head.weight.dtype if hasattr(self, "lm_head") else torch.get_default_dtype()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [K, vocab] on every rank (the vocab-parallel head gathers them)."""
        return self.lm_head(hidden)

    def cache_specs(self) -> list[LayerCacheSpec]:
        """One spec per decoder position; empty for positions another stage runs."""
        local = set(self.stage.layers)
        return [
            layer.cache_spec() if i in local else LayerCacheSpec()
            for i, layer in enumerate(self.decoder_layers())
        ]

    def stage_modules(self) -> list[nn.Module]:
        """The modules this pipeline stage runs (and holds the weights of)."""
        stage, layers = self.stage, self.decoder_layers()
        modules = [layers[i] for i in stage.layers]
        if stage.is_first or (stage.is_last and self.tie_word_embeddings):
            modules.append(self.input_embeddings())
        if stage.is_last:
            modules += [self.final_norm(), self.lm_head]
        return modules

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None]:
        """The parameter a checkpoint tensor loads into, and as which shard."""
        for fragment, replacement, shard in self.name_rules:
            if fragment in name:
                return name.replace(fragment, replacement), shard
        return name, None

    def param_to_checkpoint(self, name: str, shard: int | None) -> str:
        """The checkpoint name of a parameter's shard (for messages)."""
        for fragment, replacement, rule_shard in self.name_rules:
            if replacement in name and rule_shard == shard:
                return name.replace(replacement, fragment)
        return name


def llama_attention(cfg, ctx: ModelContext, rotary: RotaryEmbedding | None) -> Attention:
    """Attention from the config fields Llama-style checkpoints share."""
    num_heads = cfg.num_attention_heads
    return Attention(
        hidden_size=cfg.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
        ops=ctx.ops,
        tp=ctx.tp,
        rotary=rotary,
        bias=getattr(cfg, "attention_bias", False),
    )


def bamba_style_mamba2(cfg, ctx: ModelContext, **extra) -> Mamba2Mixer:
    """Mamba2 from the `mamba_*` config fields Bamba-style checkpoints share (Bamba,
    Falcon-H1, Granite 4.0-H); `extra` passes the family's own Mamba2Mixer options."""
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_n_heads,
        head_dim=cfg.mamba_d_head,
        state_size=cfg.mamba_d_state,
        n_groups=cfg.mamba_n_groups,
        conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size,
        norm_eps=cfg.rms_norm_eps,
        ops=ctx.ops,
        tp=ctx.tp,
        activation=cfg.hidden_act,
        time_step_limit=tuple(cfg.time_step_limit),
        use_bias=cfg.mamba_proj_bias,
        use_conv_bias=cfg.mamba_conv_bias,
        **extra,
    )
