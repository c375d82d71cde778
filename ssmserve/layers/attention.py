"""Attention over the paged KV cache (RoPE, GQA/MQA)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

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
# itself is a guess, not measured. Prompt chunks with cached context (the later chunks of
# a long prompt, a prefix-cache hit) of that many tokens take it too: their K/V are
# gathered from the cache and the query attends with a lower-right causal mask.
FUSED_PREFILL_MIN_TOKENS = 512
# Bytes the gathered (and, for PyTorch's kernels, head-repeated) K/V of one fused call may
# take: a long context is attended a few KV heads at a time, so the transient stays below
# what the memory plan set aside for a prefill's activations.
FUSED_CONTEXT_MAX_BYTES = 256 * 2**20
# The fused kernels only: the math backend would materialise the L x n scores.
_FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_ANY_BACKEND = [*_FUSED_BACKENDS, SDPBackend.MATH]  # CPU: unit tests at small sizes
# 16-bit attention on sm_90 goes through cuDNN's fused attention: on one H100 (2026-12-06,
# Bamba-9B's 32/8 heads of 128, an 8k-token chunk) 0.91 ms causal over its own tokens
# against flash's 1.73, and 12.95 against 23.5 ms over 64k tokens of context, split as
# below. Its masks are top-left aligned, so a chunk with context attends to the context
# unmasked and to its own tokens causally, and the two are merged by their logsumexps.
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)


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
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, tp, bias)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            out_features or hidden_size,
            tp,
            bias,
            columns=head_segment(self.qkv_proj.q_heads, head_dim, num_heads),
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
        if self.rotary is not None and batch.num_decodes == batch.num_seqs == num_tokens:
            # A decode step: RoPE, this step's K/V into the cache and the attention, in
            # one launch where the op can (batch 1 under PDL), else in two.
            out = self.ops.rotary_decode_attention(
                q, k, v, cache.k, cache.v,
                positions=batch.positions, inv_freq=self.rotary.inv_freq,
                scaling=self.rotary.attention_scaling, slot_mapping=batch.slot_mapping,
                block_tables=batch.block_tables, query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens, scale=self.scale,
            )  # fmt: skip
            return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        if self.rotary is not None:
            # RoPE on q and k, and this step's K/V into the cache, in one launch.
            q, k = self.ops.rotary_embedding(
                batch.positions, q, k, self.rotary.inv_freq,
                scaling=self.rotary.attention_scaling,
                v=v, k_cache=cache.k, v_cache=cache.v, slot_mapping=batch.slot_mapping,
            )  # fmt: skip
        else:
            self.ops.write_kv_cache(k, v, cache.k, cache.v, batch.slot_mapping)
        # Head dims the fused kernels take (flash and memory-efficient attention).
        fusable = q.is_cuda and self.head_dim % 8 == 0 and self.head_dim <= 256
        long = self._long_prefills(batch) if fusable else []
        if not long:
            out = self._paged(q, batch, cache, 0, batch.num_seqs)
        else:
            # Long prompt chunks go through PyTorch's fused attention (flash), several times
            # faster than the paged kernel: with nothing cached they attend to their own new
            # tokens, else to their K/V gathered from the cache. The other sequences go
            # through the paged kernel in runs between them.
            out = torch.empty_like(q)
            qsl, context = batch.query_start_loc_host, batch.context_lens_host
            first = 0
            for s in [*long, batch.num_seqs]:
                if first < s:
                    out[qsl[first] : qsl[s]] = self._paged(q, batch, cache, first, s)
                if s < batch.num_seqs:
                    t0, t1 = qsl[s], qsl[s + 1]
                    if context[s] == 0:
                        out[t0:t1] = self._fused_causal(q[t0:t1], k[t0:t1], v[t0:t1])
                    else:
                        n = context[s] + t1 - t0
                        out[t0:t1] = self._fused_with_context(
                            q[t0:t1], cache, batch.block_tables[s], n
                        )
                first = s + 1
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _fused_with_context(
        self, q: torch.Tensor, cache: KVCache, block_table: torch.Tensor, n: int
    ) -> torch.Tensor:
        """Attention of one sequence's last L = q.shape[0] tokens over its first n tokens
        in the cache (this step's K/V are written there already): query i sees tokens up
        to n - L + i (a lower-right causal mask). The K/V are gathered from the blocks a
        few KV heads at a time (FUSED_CONTEXT_MAX_BYTES) and their query heads attended
        together."""
        groups = self.num_heads // self.num_kv_heads
        block_size = cache.k.shape[1]
        blocks = block_table[: -(-n // block_size)].long()
        # The gathered K/V, and their copies repeated per query head unless cuDNN takes
        # the group as it is.
        copies = 1 if _cudnn_usable(q) else 1 + groups
        per_kv_head = n * self.head_dim * cache.k.element_size() * 2 * copies
        step = max(1, min(self.num_kv_heads, FUSED_CONTEXT_MAX_BYTES // per_kv_head))
        while self.num_kv_heads % step:
            step -= 1
        out = torch.empty_like(q)
        for h0 in range(0, self.num_kv_heads, step):
            h1 = h0 + step
            k = cache.k[blocks, :, h0:h1].flatten(0, 1)[:n]
            v = cache.v[blocks, :, h0:h1].flatten(0, 1)[:n]
            heads = slice(h0 * groups, h1 * groups)
            out[:, heads] = self._fused_causal(q[:, heads], k, v)
        return out

    def _fused_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one sequence's last L tokens ([L, heads, D] queries) over
        its n >= L [n, kv heads, D] keys and values with PyTorch's fused kernels: query i
        sees the first n - L + i + 1 (a lower-right causal mask; plain causal when
        n == L). cuDNN takes a group of query heads over their one KV head as it is; for
        PyTorch's kernels the KV head is repeated (a copy of these K/V only). The unfused
        math backend, which would materialise the L x n scores, runs only off the GPU
        (unit tests at small sizes)."""
        L, n = q.shape[0], k.shape[0]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if _cudnn_usable(q):
            out = self._cudnn_causal(q, k, v)
        else:
            groups = q.shape[1] // k.shape[1]
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            causal = {"is_causal": True} if L == n else {"attn_mask": causal_lower_right(L, n)}
            with sdpa_kernel(_FUSED_BACKENDS if q.is_cuda else _ANY_BACKEND):
                out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, **causal)
        return out.squeeze(0).transpose(0, 1)

    def _cudnn_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`_fused_causal` on cuDNN ([1, heads, L, D] queries and out, [1, kv heads, n, D]
        keys and values): the query's own L tokens causally and the n - L context tokens
        before them unmasked, merged by the two parts' logsumexps (softmax over the
        union)."""
        L, n = q.shape[2], k.shape[2]
        own, lse_own = _cudnn_attention(q, k[:, :, n - L :], v[:, :, n - L :], True, self.scale)
        if n == L:
            return own
        ctx, lse_ctx = _cudnn_attention(q, k[:, :, : n - L], v[:, :, : n - L], False, self.scale)
        return self.ops.merge_attention_parts(own, lse_own, ctx, lse_ctx)

    def _long_prefills(self, batch: ForwardBatch) -> list[int]:
        """Sequences with at least FUSED_PREFILL_MIN_TOKENS new tokens."""
        qsl, context = batch.query_start_loc_host, batch.context_lens_host
        return [
            s
            for s in range(batch.num_decodes, len(context))
            if qsl[s + 1] - qsl[s] >= FUSED_PREFILL_MIN_TOKENS
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


def _cudnn_usable(q: torch.Tensor) -> bool:
    """Whether `Attention._cudnn_causal` takes these queries: 16-bit, on an sm_90 GPU with
    cuDNN, head dim a multiple of 8 up to 128."""
    return (
        q.is_cuda
        and q.dtype in _CUDNN_DTYPES
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 128
        and _sm90_with_cudnn(q.device.index)
    )


@functools.cache
def _sm90_with_cudnn(device_index: int | None) -> bool:
    """The device half of `_cudnn_usable`, asked once per GPU (every long chunk of every
    attention layer asks)."""
    return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(
        device_index
    ) == (9, 0)


def _cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN fused attention ([1, heads, L, D] queries over [1, kv heads, n, D] keys and
    values, kv heads dividing heads; `causal` masks top-left aligned): the output and each
    row's logsumexp of its scaled scores, float32 [1, heads, L]."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse.view(q.shape[:3])
