"""Attention over the paged KV cache (RoPE, GQA/MQA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.rotary import RotaryEmbedding

# Prompts at least this long with no cached context use PyTorch's fused attention on the
# GPU. 32k-token prompt, Bamba-9B attention (32/8 heads of 128), H200: 30 ms per layer
# (flash) against 48 ms for the paged kernel, FLOP floor 12.8 ms
# (benchmarks/results/bamba9b_profile_2026-11-30_h200*.json). The 512-token threshold
# itself is a guess, not measured.
FUSED_PREFILL_MIN_TOKENS = 512


class Attention(nn.Module):
    """q/k/v/o projections named as in HF checkpoints; K/V live in paged blocks.

    Each step writes the new tokens' K/V into the cache first, then every query attends
    over its sequence's cached context plus itself: one op for prefill with or without
    cached context and for decode.
    """

    def __init__(self, hf_config, ops: KernelOps, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // self.num_heads
        )
        bias = getattr(hf_config, "attention_bias", False)
        hidden = hf_config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        self.ops = ops
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        self.ops.write_kv_cache(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        # Head dims the fused kernels take (flash and memory-efficient attention).
        fusable = q.is_cuda and self.head_dim % 8 == 0 and self.head_dim <= 256
        fresh = self._fresh_long_prefills(batch) if fusable else []
        if not fresh:
            out = self._paged(q, batch, 0, batch.num_seqs)
        else:
            # Long prompts with nothing cached attend only to their own new tokens: PyTorch's
            # fused attention (flash) does that several times faster than the paged kernel.
            # The other sequences go through the paged kernel in runs between them.
            out = torch.empty_like(q)
            qsl = batch.query_start_loc_host
            first = 0
            for s in [*fresh, batch.num_seqs]:
                if first < s:
                    out[qsl[first] : qsl[s]] = self._paged(q, batch, first, s)
                if s < batch.num_seqs:
                    t0, t1 = qsl[s], qsl[s + 1]
                    out[t0:t1] = self._fused_causal(q[t0:t1], k[t0:t1], v[t0:t1])
                first = s + 1
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _fused_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one sequence's [L, heads, D] tensors with PyTorch's fused
        kernels. Query heads of a group get their KV head repeated (a copy of this prompt's
        K/V only); the unfused math backend, which would materialise the L x L scores, is
        not allowed."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.squeeze(0).transpose(0, 1)

    def _fresh_long_prefills(self, batch: ForwardBatch) -> list[int]:
        """Sequences with no cached context and at least FUSED_PREFILL_MIN_TOKENS new ones."""
        qsl, context = batch.query_start_loc_host, batch.context_lens_host
        return [
            s
            for s in range(batch.num_decodes, len(context))
            if context[s] == 0 and qsl[s + 1] - qsl[s] >= FUSED_PREFILL_MIN_TOKENS
        ]

    def _paged(self, q: torch.Tensor, batch: ForwardBatch, first: int, end: int) -> torch.Tensor:
        """Paged attention for sequences [first, end) of the batch."""
        if first == 0 and end == batch.num_seqs:
            t0, t1, qsl = 0, q.shape[0], batch.query_start_loc
        else:
            t0, t1 = batch.query_start_loc_host[first], batch.query_start_loc_host[end]
            qsl = batch.query_start_loc[first : end + 1] - t0
        return self.ops.paged_attention(
            q[t0:t1],
            self.k_cache,
            self.v_cache,
            block_tables=batch.block_tables[first:end],
            query_start_loc=qsl,
            seq_lens=batch.seq_lens[first:end],
            scale=self.scale,
            num_decodes=batch.num_decodes if first == 0 else 0,
        )
