"""Paged KV cache write and paged attention (prefill over cached context, and decode).

Cache layout: [num_blocks, block_size, KVH, Dh]; token position p of sequence s lives
in block block_tables[s, p // block_size] at offset p % block_size. A flat cache slot
is block * block_size + offset.

Query i of sequence s (q_len = query_start_loc[s+1] - query_start_loc[s]) sits at
position seq_lens[s] - q_len + i and attends to cache positions
max(0, pos - sliding_window + 1) .. pos. Query head h reads KV head h // (H // KVH).
"""

from __future__ import annotations

import torch

from ssmserve.kernels._common import check_shape


def _check_kv_write_args(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[int, int, int]:
    check_shape("k", k, [None, None, None])
    T, KVH, Dh = k.shape
    check_shape("v", v, [T, KVH, Dh])
    check_shape("k_cache", k_cache, [None, None, KVH, Dh])
    check_shape("v_cache", v_cache, list(k_cache.shape))
    check_shape("slot_mapping", slot_mapping, [T])
    return T, KVH, Dh


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys and values into the paged caches, in place.

    Args:
        k, v: [T, KVH, Dh].
        k_cache, v_cache: [num_blocks, block_size, KVH, Dh].
        slot_mapping: [T] int64 flat slot (block * block_size + offset); < 0 = skip.
    """
    _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    rows = torch.nonzero(slot_mapping >= 0).squeeze(1)
    slots = slot_mapping[rows].long()
    KVH, Dh = k.shape[1:]
    k_cache.view(-1, KVH, Dh)[slots] = k[rows].to(k_cache.dtype)
    v_cache.view(-1, KVH, Dh)[slots] = v[rows].to(v_cache.dtype)


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    check_shape("q", q, [None, None, None])
    T, H, Dh = q.shape
    check_shape("k_cache", k_cache, [None, None, None, Dh])
    KVH = k_cache.shape[2]
    check_shape("v_cache", v_cache, list(k_cache.shape))
    if H % KVH != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({KVH})")
    check_shape("seq_lens", seq_lens, [None])
    S = seq_lens.shape[0]
    check_shape("block_tables", block_tables, [S, None])
    check_shape("query_start_loc", query_start_loc, [S + 1])
    return T, H, KVH, Dh, S


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over a paged KV cache, softmax in float32.

    Args:
        q: [T, H, Dh] queries of all sequences, packed (H a multiple of KVH).
        k_cache, v_cache: [num_blocks, block_size, KVH, Dh], this step's keys and
            values already written.
        block_tables: [S, max_blocks] int32.
        query_start_loc: [S+1] int32; queries of sequence s are rows qsl[s]:qsl[s+1].
        seq_lens: [S] tokens of sequence s in the cache, this step's included.
        scale: softmax scale (usually Dh ** -0.5).
        sliding_window: if set, a query attends to at most this many latest positions
            (itself included).

    Returns:
        out: [T, H, Dh] in q.dtype.
    """
    T, H, KVH, Dh, S = _check_attention_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens
    )
    block_size = k_cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.zeros(T, H, Dh, dtype=q.dtype, device=q.device)
    for s in range(S):
        q_len, n = qsl[s + 1] - qsl[s], lens[s]
        if q_len == 0:
            continue
        if q_len > n:
            raise ValueError(f"sequence {s} has {q_len} queries but only {n} cached tokens")
        blocks = block_tables[s, : (n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, KVH, Dh)[:n].float()
        v = v_cache[blocks].reshape(-1, KVH, Dh)[:n].float()
        k = k.repeat_interleave(H // KVH, dim=1)
        v = v.repeat_interleave(H // KVH, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qsl[s] : qsl[s + 1]].float(), k) * scale
        q_pos = torch.arange(n - q_len, n, device=q.device)[:, None]
        k_pos = torch.arange(n, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        probs = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1)
        out[qsl[s] : qsl[s + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
