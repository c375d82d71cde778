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

from ssmserve.kernels._common import check_shape, interpret_mode, lazy_jit, next_pow2, tl


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


# ---------------------------------------------------------------------------- Triton


@lazy_jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, KVH, Dh, block_size,
    stride_k_t, stride_k_h, stride_k_d, stride_v_t, stride_v_h, stride_v_d,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < Dh) & (slot >= 0)
    k = tl.load(k_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h
                + offs_d[None, :] * stride_k_d, mask=mask)  # fmt: skip
    v = tl.load(v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h
                + offs_d[None, :] * stride_v_d, mask=mask)  # fmt: skip
    tl.store(k_cache_ptr + block * stride_kc_b + offset * stride_kc_o
             + offs_h[:, None] * stride_kc_h + offs_d[None, :] * stride_kc_d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)  # fmt: skip
    tl.store(v_cache_ptr + block * stride_vc_b + offset * stride_vc_o
             + offs_h[:, None] * stride_vc_h + offs_d[None, :] * stride_vc_d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton twin of `write_kv_cache_ref`; no host sync (CUDA-graph safe)."""
    T, KVH, Dh = _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, KVH, Dh, k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=next_pow2(KVH), BLOCK_D=next_pow2(Dh),
    )  # fmt: skip


@lazy_jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, scale, num_seqs, heads_per_kv, Dh, block_size, window,
    stride_q_t, stride_q_h, stride_q_d,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d,
    stride_o_t, stride_o_h, stride_o_d, stride_bt_s, stride_bt_b,
    HAS_WINDOW: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Query blocks are numbered so that sequence s owns ids from
    # qsl[s] // BLOCK_M + s on; that numbering is strictly increasing in s, so a
    # binary search maps a program to its sequence with no host-side metadata.
    pid = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // heads_per_kv
    lo = 0
    hi = num_seqs
    for _ in tl.static_range(SEARCH_STEPS):  # invariant: first_block(lo) <= pid
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        go_right = (first_block <= pid) & (hi - lo > 1)
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(~go_right & (hi - lo > 1), mid, hi)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    m_block = pid - (q_start // BLOCK_M + seq)
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < Dh
    q_pos = seq_len - q_len + offs_m
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_q_t + head * stride_q_h
                + offs_d[None, :] * stride_q_d,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
    q = (q.to(tl.float32) * scale).to(DOT_DTYPE)

    # Keys this block can see: [kv_lo, kv_hi); empty when the block has no queries.
    kv_hi = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_M)
    kv_hi = tl.where(m_block * BLOCK_M < q_len, kv_hi, 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - q_len + m_block * BLOCK_M - window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = k_pos < kv_hi
        block = tl.load(block_tables_ptr + seq * stride_bt_s + (k_pos // block_size) * stride_bt_b,
                        mask=mask_n, other=0).to(tl.int64)  # fmt: skip
        offset = k_pos % block_size
        k = tl.load(k_cache_ptr + block[:, None] * stride_kc_b + offset[:, None] * stride_kc_o
                    + kv_head * stride_kc_h + offs_d[None, :] * stride_kc_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        v = tl.load(v_cache_ptr + block[:, None] * stride_vc_b + offset[:, None] * stride_vc_o
                    + kv_head * stride_vc_h + offs_d[None, :] * stride_vc_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & mask_n[None, :] & mask_m[:, None]
        if HAS_WINDOW:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = tl.where(allowed, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows with nothing allowed yet keep m = -inf; subtract 0 there to avoid NaN.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                            input_precision=DOT_PRECISION)  # fmt: skip
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_o_t + head * stride_o_h
             + offs_d[None, :] * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])  # fmt: skip


def paged_attention_triton(
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
    """Triton twin of `paged_attention_ref` (same arguments, shapes and result).

    One program per (block of up to 16 queries of one sequence, query head), flash-
    style online softmax over the sequence's cache blocks. No host sync.
    """
    T, H, KVH, Dh, S = _check_attention_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens
    )
    out = torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    block_m, block_n = 16, 32
    if q.dtype == torch.float32 or interpret_mode():
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
        precision = "tf32"
    grid = (T // block_m + S, H)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, float(scale),
        S, H // KVH, Dh, k_cache.shape[1], sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *block_tables.stride(),
        HAS_WINDOW=sliding_window is not None, SEARCH_STEPS=max(1, S.bit_length()),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(Dh)),
        DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
    )  # fmt: skip
    return out
