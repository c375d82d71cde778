"""Attention over the paged KV cache (RoPE, GQA/MQA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import KVCache, KVCacheSpec
from ssmserve.layers.linear import QKVParallelLinear, RowParallelLinear, head_segment
from ssmserve.layers.rotary import RotaryEmbedding

# Prompts at least this long with no cached context use PyTorch's fused attention on the
# GPU. 32k-token prompt, Bamba-9B attention (32/8 heads of 128), H200: 30 ms per layer
# (flash) against 48 ms for the paged kernel, FLOP floor 12.8 ms
# (benchmarks/results/bamba9b_profile_2026-11-30_h200*.json). The 512-token threshold
# itself is a guess, not measured.
FUSED_PREFILL_MIN_TOKENS = 512


class Attention(nn.Module):
    """Fused QKV projection (query heads split over ranks, KV heads split or replicated),
    RoPE, paged KV cache, row-parallel output projection.

    Each step writes the new tokens' K/V into the cache first, then every query attends
    over its sequence's cached context plus itself: one op for prefill with or without
    cached context and for decode.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        ops: KernelOps,
        tp: TensorParallel,
        rotary: RotaryEmbedding | None,
        bias: bool = False,
        scale: float | None = None,
        out_features: int | None = None,
    ) -> None:
        """`out_features` is o_proj's output width (default `hidden_size`, the input's)."""
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, tp, bias, ops
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            out_features or hidden_size,
            tp,
            bias,
            columns=head_segment(self.qkv_proj.q_heads, head_dim, num_heads),
            ops=ops,
        )
        self.scale = head_dim**-0.5 if scale is None else scale
        self.rotary = rotary
        self.ops = ops

    def cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        qkv_delta: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`qkv_delta` (this rank's q/k/v columns, as qkv_proj gives them) is added to the
        projection before RoPE: a per-use adapter's output (Zamba2's LoRA)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if qkv_delta is not None:
            qkv = qkv + qkv_delta
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.ops.rotary_embedding(
                batch.positions, q, k, self.rotary.inv_freq, scaling=self.rotary.attention_scaling
            )
        self.ops.write_kv_cache(k, v, cache.k, cache.v, batch.slot_mapping)
        # Head dims the fused kernels take (flash and memory-efficient attention).
        fusable = q.is_cuda and self.head_dim % 8 == 0 and self.head_dim <= 256
        fresh = self._fresh_long_prefills(batch) if fusable else []
        if not fresh:
            out = self._paged(q, batch, cache, 0, batch.num_seqs)
        else:
            # Long prompts with nothing cached attend only to their own new tokens: PyTorch's
            # fused attention (flash) does that several times faster than the paged kernel.
            # The other sequences go through the paged kernel in runs between them.
            out = torch.empty_like(q)
            qsl = batch.query_start_loc_host
            first = 0
            for s in [*fresh, batch.num_seqs]:
                if first < s:
                    out[qsl[first] : qsl[s]] = self._paged(q, batch, cache, first, s)
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

    def _paged(
        self, q: torch.Tensor, batch: ForwardBatch, cache: KVCache, first: int, end: int
    ) -> torch.Tensor:
        """Paged attention for sequences [first, end) of the batch."""
        if first == 0 and end == batch.num_seqs:
            t0, t1, qsl = 0, q.shape[0], batch.query_start_loc
        else:
            t0, t1 = batch.query_start_loc_host[first], batch.query_start_loc_host[end]
            qsl = batch.query_start_loc[first : end + 1] - t0
        return self.ops.paged_attention(
            q[t0:t1],
            cache.k,
            cache.v,
            block_tables=batch.block_tables[first:end],
            query_start_loc=qsl,
            seq_lens=batch.seq_lens[first:end],
            scale=self.scale,
            num_decodes=batch.num_decodes if first == 0 else 0,
        )
