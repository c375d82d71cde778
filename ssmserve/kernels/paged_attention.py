"""Paged KV cache write and paged attention (prefill over cached context, and decode).

Cache layout: [num_blocks, block_size, KVH, Dh]; token position p of sequence s lives
in block block_tables[s, p // block_size] at offset p % block_size. A flat cache slot
is block * block_size + offset.

Query i of sequence s (q_len = query_start_loc[s+1] - query_start_loc[s]) sits at
position seq_lens[s] - q_len + i and attends to cache positions
max(0, pos - sliding_window + 1) .. pos. Query head h reads KV head h // (H // KVH).

`num_decodes` (a host-side count, like ForwardBatch.num_decodes) says the first
sequences have exactly one query each; the Triton launcher gives them its decode kernel
without reading any device tensor, so the choice is CUDA-graph safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ssmserve.kernels._common import (
    check_shape,
    device_function,
    gdc_launch_dependents,
    gdc_wait,
    interpret_mode,
    launch_config,
    lazy_jit,
    next_pow2,
    num_sms,
    pdl_launch,
    tl,
)


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
    *,
    pdl: bool = False,
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
    num_decodes: int,
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
    if not 0 <= num_decodes <= min(S, T):
        raise ValueError(
            f"num_decodes must lie in [0, min(sequences, queries)] = [0, {min(S, T)}], "
            f"got {num_decodes}"
        )
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
    num_decodes: int = 0,
    pdl: bool = False,
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
        num_decodes: the first num_decodes sequences have exactly one query each (0 =
            nothing known; the result does not depend on it).

    Returns:
        out: [T, H, Dh] in q.dtype.
    """
    T, H, KVH, Dh, S = _check_attention_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_decodes
    )
    block_size = k_cache.shape[1]
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if any(qsl[s + 1] - qsl[s] != 1 for s in range(num_decodes)):
        raise ValueError(
            f"num_decodes={num_decodes} but the first sequences' query counts are "
            f"{[qsl[s + 1] - qsl[s] for s in range(num_decodes)]}; each must be 1"
        )
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


@lazy_jit(do_not_specialize=("slot_mapping_ptr",))
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    KVH,
    Dh,
    block_size,
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_vc_d,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < Dh) & (slot >= 0)
    k = tl.load(
        k_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :] * stride_k_d,
        mask=mask,
    )
    v = tl.load(
        v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :] * stride_v_d,
        mask=mask,
    )
    tl.store(
        k_cache_ptr
        + block * stride_kc_b
        + offset * stride_kc_o
        + offs_h[:, None] * stride_kc_h
        + offs_d[None, :] * stride_kc_d,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + block * stride_vc_b
        + offset * stride_vc_o
        + offs_h[:, None] * stride_vc_h
        + offs_d[None, :] * stride_vc_d,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> None:
    """Triton twin of `write_kv_cache_ref`; no host sync (CUDA-graph safe)."""
    T, KVH, Dh = _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        KVH,
        Dh,
        k_cache.shape[1],
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_H=next_pow2(KVH),
        BLOCK_D=next_pow2(Dh),
        PDL=pdl,
        **pdl_launch(pdl),
    )


# Both attention paths run one kernel. A program owns BLOCK_Q queries of one sequence and
# one KV head, and makes the rows of its dots from (query, query head of that KV head's
# group) pairs: row r is query r // HEADS_PER_KV, head kv_head * HEADS_PER_KV +
# r % HEADS_PER_KV. So each KV tile is read once for the whole group, and a decode
# (BLOCK_Q = 1) fills the rows with the group's heads instead of 15 empty queries.
#
# Prefill: programs are numbered so that sequence s owns ids from
# (qsl[s] - qsl[first]) // BLOCK_Q + (s - first) on; that numbering is strictly increasing
# in s, so a binary search maps a program to its sequence with no host-side metadata.
# Decode (SEARCH_SEQS false): program id = sequence, and the context may be split over
# num_splits programs (flash-decoding, SPLIT_KV), each writing a normalised partial output
# and its log2-sum-exp; `_merge_splits_kernel` combines them. Counts that follow the batch
# (sequences, search steps, splits, the block table's width) are runtime values, so one
# compiled kernel per path serves every batch.


@device_function
def _block_ids(bt_row, k_pos, load_mask, block_size, stride_bt_b, MASKED: tl.constexpr):
    """The cache blocks of key positions k_pos (block 0 where MASKED and not load_mask)."""
    if MASKED:
        block = tl.load(bt_row + (k_pos // block_size) * stride_bt_b, mask=load_mask, other=0)
    else:
        block = tl.load(bt_row + (k_pos // block_size) * stride_bt_b)
    return block.to(tl.int64)


@device_function
def _kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block,
    k_pos,
    load_mask,
    kv_head,
    offs_d,
    mask_d,
    block_size,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_vc_d,
    MASKED: tl.constexpr,
):
    """The K and V rows of key positions k_pos in cache blocks `block` (zero where MASKED
    and not load_mask)."""
    if MASKED:
        mask_nd = load_mask[:, None] & mask_d[None, :]
    else:
        mask_nd = mask_d[None, :]
    offset = k_pos % block_size
    k = tl.load(
        k_cache_ptr
        + block[:, None] * stride_kc_b
        + offset[:, None] * stride_kc_o
        + kv_head * stride_kc_h
        + offs_d[None, :] * stride_kc_d,
        mask=mask_nd,
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr
        + block[:, None] * stride_vc_b
        + offset[:, None] * stride_vc_o
        + kv_head * stride_vc_h
        + offs_d[None, :] * stride_vc_d,
        mask=mask_nd,
        other=0.0,
    )
    return k, v


@device_function
def _attend_tile(
    q,
    k,
    v,
    k_pos,
    q_pos,
    kv_hi,
    window,
    qk_scale,
    m_i,
    l_i,
    acc,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_N-key tile of the online softmax; MASKED: causal / window / end."""
    scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    scores *= qk_scale
    if MASKED:
        # Rows past the valid ones are never stored, so they need no mask here.
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < kv_hi)[None, :]
        if HAS_WINDOW:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = tl.where(allowed, scores, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # Rows with nothing allowed yet keep m = -inf; subtract 0 there to avoid NaN.
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(
        p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
    )
    return m_new, l_i, acc


@device_function
def _rope(x, partner, cos, sin):
    """RoPE of `x` (q's dtype) whose rotation partners (dim d +- rotary_dim / 2) are
    `partner`, by float32 `cos` and `sin` already rounded to the dtype, sin negated on the
    first half: `_rotary_kernel`'s arithmetic, each product and the sum rounded to the
    dtype (a - b there is a + (-b) here, the same bits)."""
    dtype = x.dtype
    xc = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    ps = (partner.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (xc + ps).to(dtype)


@device_function
def _rope_angles(pos_ptr, freq_ptr, token, offs_d, half, scaling, dtype):
    """RoPE at `token`'s position over a head's dims `offs_d`: cos and sin as
    `_rotary_kernel` rounds them (to `dtype`), sin negated on the first half, each dim's
    rotation partner, and which dims rotate."""
    lower = offs_d < half
    in_rot = offs_d < 2 * half
    freq = tl.load(freq_ptr + tl.where(lower, offs_d, offs_d - half), mask=in_rot, other=0.0)
    angle = tl.load(pos_ptr + token).to(tl.float32) * freq
    cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
    partner = tl.where(lower, offs_d + half, offs_d - half)
    return cos, tl.where(lower, -sin, sin), partner, in_rot


@device_function
def _own_key_value(
    kn_row, vn_row, k_cache_ptr, v_cache_ptr, slot, write, offs_d, mask_d, angles,
    block_size, stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d, kv_head,
):  # fmt: skip
    """A sequence's new key (rotated) and value for one KV head, in the caches' dtypes,
    stored at `slot` where `write`."""
    cos, sin, partner, in_rot = angles
    k = tl.load(kn_row + offs_d, mask=mask_d, other=0.0)
    k_partner = tl.load(kn_row + partner, mask=mask_d, other=0.0)
    k = tl.where(in_rot, _rope(k, k_partner, cos, sin), k).to(k_cache_ptr.dtype.element_ty)
    v = tl.load(vn_row + offs_d, mask=mask_d, other=0.0).to(v_cache_ptr.dtype.element_ty)
    block, offset = slot // block_size, slot % block_size
    tl.store(
        k_cache_ptr + block * stride_kc_b + offset * stride_kc_o + kv_head * stride_kc_h
        + offs_d * stride_kc_d, k, mask=mask_d & write,
    )  # fmt: skip
    tl.store(
        v_cache_ptr + block * stride_vc_b + offset * stride_vc_o + kv_head * stride_vc_h
        + offs_d * stride_vc_d, v, mask=mask_d & write,
    )  # fmt: skip
    return k, v


@lazy_jit(
    do_not_specialize=(
        "block_tables_ptr",
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "first_seq",
        "num_seqs",
        "search_steps",
        "num_splits",
        "stride_bt_s",
        "pos_ptr",
        "slot_ptr",
    )
)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    first_seq,
    num_seqs,
    search_steps,
    num_splits,
    Dh,
    block_size,
    window,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    stride_vc_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_bt_s,
    stride_bt_b,
    kn_ptr,
    vn_ptr,
    pos_ptr,
    freq_ptr,
    slot_ptr,
    rope_half,
    rope_scaling,
    stride_kn_t,
    stride_kn_h,
    stride_vn_t,
    stride_vn_h,
    HEADS_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    SEARCH_SEQS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    MASK_SKIP: tl.constexpr,
    ROPE: tl.constexpr,
):
    # PREFETCH (decode; pays with PDL): the split's first key tile is read before the
    # wait. A kernel of this step (RoPE's cache write) writes only the sequence's last
    # q_len positions, so those alone are read after it.
    # ROPE (decode with PREFETCH): q_ptr holds the step's queries before RoPE, kn_ptr /
    # vn_ptr its new keys and values. Each program rotates its query heads; the program
    # whose keys include the step's own position rotates the new key and writes it and
    # the value to the caches at the step's slot, and the tile holding that position
    # takes them from registers instead of the cache: `rotary_embedding` (with its cache
    # write) and the attention of its output, in one launch.
    tl.static_assert(PREFETCH or not ROPE, "ROPE takes PREFETCH's few tiles a split")
    if PDL:
        gdc_launch_dependents()
        if not PREFETCH:
            gdc_wait()
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SEARCH_SEQS:
        base = tl.load(query_start_loc_ptr + first_seq)
        lo = 0
        hi = num_seqs
        for _ in range(search_steps):  # invariant: first id of lo <= pid
            mid = (lo + hi) // 2
            first_id = (tl.load(query_start_loc_ptr + first_seq + mid) - base) // BLOCK_Q + mid
            go_right = (first_id <= pid) & (hi - lo > 1)
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(~go_right & (hi - lo > 1), mid, hi)
        seq = first_seq + lo
        q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        m_block = pid - ((q_start - base) // BLOCK_Q + lo)
    else:
        seq = first_seq + pid
        q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
        m_block = 0
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = m_block * BLOCK_Q + rows // HEADS_PER_KV  # query index within the sequence
    head = kv_head * HEADS_PER_KV + rows % HEADS_PER_KV
    mask_m = (rows < BLOCK_Q * HEADS_PER_KV) & (q_idx < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    q_pos = seq_len - q_len + q_idx

    # Keys this program can see: [kv_lo, kv_hi); empty when it has no queries.
    kv_hi = tl.minimum(seq_len, seq_len - q_len + (m_block + 1) * BLOCK_Q)
    kv_hi = tl.where(m_block * BLOCK_Q < q_len, kv_hi, 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - q_len + m_block * BLOCK_Q - window + 1, 0)
        kv_lo = (kv_lo // BLOCK_N) * BLOCK_N
    if SPLIT_KV:
        # Whole tiles per split; a split past the end of a short sequence is empty.
        tiles = tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
        split_len = tl.cdiv(tiles, num_splits) * BLOCK_N
        kv_lo = kv_lo + split * split_len
        kv_hi = tl.minimum(kv_hi, kv_lo + split_len)

    bt_row = block_tables_ptr + seq * stride_bt_s
    if ROPE:
        # The step's inputs (position, slot) and the frequencies, before the wait.
        angles = _rope_angles(pos_ptr, freq_ptr, q_start, offs_d, rope_half, rope_scaling,
                              q_ptr.dtype.element_ty)  # fmt: skip
        slot = tl.load(slot_ptr + q_start).to(tl.int64)
        last = seq_len - 1  # the step's own position
        kn_row = kn_ptr + q_start * stride_kn_t + kv_head * stride_kn_h
        vn_row = vn_ptr + q_start * stride_vn_t + kv_head * stride_vn_h
    if PREFETCH:
        first = kv_lo + tl.arange(0, BLOCK_N)
        old = first < tl.minimum(kv_hi, seq_len - q_len)
        # The tile's blocks (the step's input) serve both reads.
        block = _block_ids(bt_row, first, first < kv_hi, block_size, stride_bt_b, MASKED=True)
        k0, v0 = _kv_tile(
            k_cache_ptr, v_cache_ptr, block, first, old, kv_head, offs_d, mask_d,
            block_size, stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
            stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d, MASKED=True,
        )  # fmt: skip
        if PDL:
            gdc_wait()
        if not ROPE:
            new = (first >= seq_len - q_len) & (first < kv_hi)
            k_new, v_new = _kv_tile(
                k_cache_ptr, v_cache_ptr, block, first, new, kv_head, offs_d, mask_d,
                block_size, stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
                stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d, MASKED=True,
            )  # fmt: skip
            k0 = tl.where(new[:, None], k_new, k0)
            v0 = tl.where(new[:, None], v_new, v0)
    q_rows = q_ptr + (q_start + q_idx)[:, None] * stride_q_t + head[:, None] * stride_q_h
    mask_q = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_rows + offs_d[None, :] * stride_q_d, mask=mask_q, other=0.0)
    if ROPE:
        cos, sin, partner, in_rot = angles
        q_partner = tl.load(q_rows + partner[None, :] * stride_q_d, mask=mask_q, other=0.0)
        q = tl.where(in_rot[None, :], _rope(q, q_partner, cos[None, :], sin[None, :]), q)
        # One split holds the step's position and writes the caches (a slot < 0, a
        # padding row's, writes nothing).
        owner = (kv_lo <= last) & (last < kv_hi)
        k_own, v_own = _own_key_value(
            kn_row, vn_row, k_cache_ptr, v_cache_ptr, slot, owner & (slot >= 0),
            offs_d, mask_d, angles, block_size, stride_kc_b, stride_kc_o, stride_kc_h,
            stride_kc_d, stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d, kv_head,
        )  # fmt: skip
        own = (first == last)[:, None]
        k0 = tl.where(own, k_own[None, :], k0)
        v0 = tl.where(own, v_own[None, :], v0)
    q = q.to(DOT_DTYPE)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    loop_lo = kv_lo
    if PREFETCH:
        m_i, l_i, acc = _attend_tile(
            q, k0, v0, first, q_pos, kv_hi, window, qk_scale, m_i, l_i, acc,
            True, HAS_WINDOW, DOT_DTYPE, DOT_PRECISION,
        )  # fmt: skip
        loop_lo = kv_lo + BLOCK_N
    # Tiles every query of the program sees whole (all keys before its first query, none
    # past kv_hi) need no mask: only the last few tiles, on the diagonal, do. Without
    # MASK_SKIP every tile is masked, in one loop.
    if HAS_WINDOW or not MASK_SKIP:
        full_hi = loop_lo
    else:
        first_q_pos = seq_len - q_len + m_block * BLOCK_Q
        visible = tl.minimum(kv_hi, first_q_pos + 1) - kv_lo
        full_hi = kv_lo + tl.maximum(visible, 0) // BLOCK_N * BLOCK_N
    tiles_end = kv_hi
    if ROPE:
        # The split holding the step's own key leaves its tile, the last, to the end.
        own_tile = kv_lo + (last - kv_lo) // BLOCK_N * BLOCK_N
        tiles_end = tl.where(owner, own_tile, kv_hi)
        full_hi = tl.minimum(full_hi, tiles_end)
    for MASKED in tl.static_range(2):  # the whole tiles, then the masked ones
        if MASKED:
            tiles_lo, tiles_hi = tl.maximum(full_hi, loop_lo), tiles_end
        else:
            tiles_lo, tiles_hi = loop_lo, full_hi
        for n0 in range(tiles_lo, tiles_hi, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            loaded = k_pos < kv_hi
            block = _block_ids(bt_row, k_pos, loaded, block_size, stride_bt_b, MASKED=MASKED)
            k, v = _kv_tile(
                k_cache_ptr, v_cache_ptr, block, k_pos, loaded, kv_head, offs_d, mask_d,
                block_size, stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
                stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d, MASKED=MASKED,
            )  # fmt: skip
            m_i, l_i, acc = _attend_tile(
                q, k, v, k_pos, q_pos, kv_hi, window, qk_scale, m_i, l_i, acc,
                MASKED, HAS_WINDOW, DOT_DTYPE, DOT_PRECISION,
            )  # fmt: skip
    if ROPE:
        # The own key's tile where it is not the prefetched one (once, in its split), that
        # key's row from registers. Apart from the loops, whose tiles then go from the
        # cache to the dots untouched.
        for n0 in range(tl.maximum(tiles_end, loop_lo), kv_hi, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            old_key = k_pos < tl.minimum(kv_hi, last)
            block = _block_ids(bt_row, k_pos, old_key, block_size, stride_bt_b, MASKED=True)
            k, v = _kv_tile(
                k_cache_ptr, v_cache_ptr, block, k_pos, old_key, kv_head, offs_d, mask_d,
                block_size, stride_kc_b, stride_kc_o, stride_kc_h, stride_kc_d,
                stride_vc_b, stride_vc_o, stride_vc_h, stride_vc_d, MASKED=True,
            )  # fmt: skip
            own = (k_pos == last)[:, None]
            k = tl.where(own, k_own[None, :], k)
            v = tl.where(own, v_own[None, :], v)
            m_i, l_i, acc = _attend_tile(
                q, k, v, k_pos, q_pos, kv_hi, window, qk_scale, m_i, l_i, acc,
                True, HAS_WINDOW, DOT_DTYPE, DOT_PRECISION,
            )  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    mask_out = mask_m[:, None] & mask_d[None, :]
    if not SPLIT_KV:
        tl.store(
            out_ptr
            + (q_start + q_idx)[:, None] * stride_o_t
            + head[:, None] * stride_o_h
            + offs_d[None, :] * stride_o_d,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_out,
        )
    else:
        # Partials are [seqs, H, num_splits, BLOCK_D] and [seqs, H, num_splits], contiguous.
        part = (seq * (HEADS_PER_KV * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=mask_out)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), -float("inf"))
        tl.store(part_lse_ptr + part, lse, mask=mask_m)


@lazy_jit(do_not_specialize=("query_start_loc_ptr", "num_splits"))
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_splits,
    Dh,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    lse = tl.load(part_lse_ptr + part + offs_s, mask=mask_s, other=-float("inf"))
    m = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(m == -float("inf"), 0.0, m))  # 0 for empty splits
    total = tl.sum(weight, axis=0)
    # Columns past Dh were never written (the partials' stores stop at Dh): mask them too.
    parts = tl.load(
        part_out_ptr + (part + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=mask_s[:, None] & (offs_d < Dh)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(
        out_ptr + q_start * stride_o_t + head * stride_o_h + offs_d * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < Dh,
    )


_MAX_SPLITS = 64  # context splits per (sequence, KV head) the decode default goes up to


def decode_launch_config(
    num_seqs: int,
    KVH: int,
    heads_per_kv: int,
    Dh: int,
    max_context: int,
    device: torch.device,
    config: Mapping[str, Any] | None = None,
    pdl: bool = False,
) -> dict[str, Any]:
    """Launch parameters of the decode path, `config` overriding the defaults
    (benchmarks/kernels/bench_paged_attention.py sweeps them). `pdl`: the launch is one.
    The defaults take one of a few compile variants (split or not, one or two stages,
    prefetch with PDL), whatever the batch.

    block_m: rows of the dots, the group's query heads padded to 16 (>= the group).
    block_n: keys per tile; 32 where 64 would spill registers (wide groups, Dh > 128).
    num_splits: programs per (sequence, KV head). Enough that all of them fill the GPU
        about four times over, but no split shorter than two tiles of the longest
        context the block tables can hold. Only host numbers decide it, so one CUDA graph
        serves every context length up to that.
    prefetch: read each split's first key tile before waiting for the kernel before
        (with PDL; all but the step's own keys, which that kernel writes). On where a
        split has at most two tiles: at batch 1 after a 2k prompt (32 splits of one or
        two) a chain of 16 launches with PDL took 12.9 µs a launch against 14.1 on the
        H100, and Llama-3-8B's token 5.74 ms against 5.82; with eight tiles a split
        (batch 1 at 32k, batch 8 at 4k) the held tile cost more than it hid (70.9
        against 56.2 µs, 70.0 against 63.4).
    num_warps, num_stages: Triton launch options. One stage where a split has at most
        eight tiles (the same sweep: 10.5 against 12.9 µs at batch 1 and 2k, 54.8
        against 57.4 at 32k, 54.7 against 57.2 at batch 8 and 4k), two beyond (batch 64
        at 4k, one split of 64 tiles: 0.450 ms against 0.501 with one stage; on the
        H200 0.288 against 0.319, benchmarks/results/paged_attention_2026-11-30_h200.json).
        The splits are set by the host's numbers, so these are too.
    mask_skip: the whole tiles without masks, then the masked ones (two loops); without,
        every tile masked in one loop. On with one stage only: with two, the second loop
        costs the first its pipelining (one H100, 2026-12-06, c38597d: batch 64 at 4k
        0.351 ms without against 0.449 with, and Llama-3-8B's batch-64 step at 5k 20.2
        against 24.1 ms; with one stage it pays: batch 8 at 4k 54.7 against 76.2 µs,
        batch 1 at 32k 55.0 against 76.8, batch 1 at 2k 10.5 against 11.0).
    """
    block_m = max(16, next_pow2(heads_per_kv))
    block_n = 64 if block_m * max(16, next_pow2(Dh)) <= 16 * 128 else 32
    # The interpreter has no SMs; a small stand-in lets CPU tests reach the split path.
    sms = num_sms(device) if device.type == "cuda" else 2
    num_splits = max(1, 4 * sms // max(1, num_seqs * KVH))
    num_splits = min(num_splits, _MAX_SPLITS, max(1, -(-max_context // (2 * block_n))))
    split_tiles = -(-max_context // (block_n * num_splits))  # at the longest context
    default = {
        "block_m": block_m,
        "block_n": block_n,
        "num_splits": num_splits,
        "num_warps": 4,
        "num_stages": 1 if split_tiles <= 8 else 2,
        "prefetch": pdl and split_tiles <= 2,
        "mask_skip": split_tiles <= 8,
    }
    return _checked_rows("decode", launch_config("paged_attention", default, config), heads_per_kv)


def _checked_rows(path: str, cfg: dict[str, Any], heads_per_kv: int) -> dict[str, Any]:
    """`cfg` if its tiles can hold a KV head's query group (tl.dot needs dims >= 16)."""
    if cfg["block_m"] < max(16, heads_per_kv) or cfg["block_n"] < 16:
        raise ValueError(
            f"paged_attention {path}: block_m must be at least 16 and the query heads per KV "
            f"head ({heads_per_kv}), block_n at least 16, got {cfg}"
        )
    return cfg


def prefill_launch_config(
    heads_per_kv: int, Dh: int, config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Launch parameters of the prefill path, `config` overriding the defaults: about 128
    rows of (query, head) per program.

    block_m: rows of the dots (block_q = block_m // heads_per_kv queries per program).
    block_n: keys per tile. num_warps, num_stages: Triton launch options.
    mask_skip: as the decode path's; on (the figures below are with it). With several
        stages it cost the decode path its pipelining; not yet timed here without it.

    Head dims up to 128 (H200, 32/8 heads of 128, bf16): 128 rows, 64-key tiles, 8 warps
    and 3 stages take a 2k chunk over 30k cached tokens in 4.68 ms and an 8k chunk over
    24k in 16.6 ms, against 5.88 and 18.5 ms with 64 rows, 32-key tiles, 4 warps, 2 stages
    (benchmarks/results/paged_attention_2026-11-30b_h200.json); larger head dims keep the
    smaller tiles.
    """
    if Dh <= 128:
        block_m = max(128, next_pow2(heads_per_kv))
        default = {"block_m": block_m, "block_n": 64, "num_warps": 8, "num_stages": 3}
    else:
        block_m = max(64, next_pow2(heads_per_kv))
        default = {"block_m": block_m, "block_n": 32, "num_warps": 8, "num_stages": 2}
    default["mask_skip"] = True
    cfg = _checked_rows("prefill", launch_config("paged_attention", default, config), heads_per_kv)
    return {**cfg, "block_q": cfg["block_m"] // heads_per_kv}


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
    num_decodes: int = 0,
    decode_config: Mapping[str, Any] | None = None,
    prefill_config: Mapping[str, Any] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton twin of `paged_attention_ref` (same arguments, shapes and result).

    The first `num_decodes` sequences take the decode path: one program per (sequence,
    KV head, context split), the group's query heads as the rows of its dots, so each KV
    block is read once per KV head. The rest take the prefill path: one program per
    (block of queries, KV head), flash-style online softmax. No host sync.
    `decode_config` and `prefill_config` override the paths' launch parameters (see
    `decode_launch_config` and `prefill_launch_config`; benchmarks and tests only).
    """
    T, H, KVH, Dh, S = _check_attention_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_decodes
    )
    out = torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    launch = _AttentionLaunch(
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
        sliding_window, pdl,
    )  # fmt: skip
    if num_decodes > 0:
        launch.decode(num_decodes, launch.decode_config(num_decodes, decode_config))
    num_prefills = S - num_decodes
    if num_prefills > 0:
        cfg = prefill_launch_config(H // KVH, Dh, prefill_config)
        # decodes hold exactly one query each, so the prefills hold T - num_decodes
        grid = ((T - num_decodes) // cfg["block_q"] + num_prefills, KVH, 1)
        _paged_attention_kernel[grid](
            q,
            k_cache,
            v_cache,
            out,
            out,
            out,
            *launch.args,
            num_decodes,
            num_prefills,
            num_prefills.bit_length(),
            1,
            *launch.strides,
            *_NO_ROPE,
            BLOCK_Q=cfg["block_q"],
            SPLIT_KV=False,
            SEARCH_SEQS=True,
            BLOCK_M=cfg["block_m"],
            BLOCK_N=cfg["block_n"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **launch.meta,
            PDL=pdl,
            PREFETCH=False,
            MASK_SKIP=cfg["mask_skip"],
            ROPE=False,
            **pdl_launch(pdl),
        )
    return out


# The kernel's RoPE arguments where it applies none.
_NO_ROPE = (None, None, None, None, None, 0, 1.0, 0, 0, 0, 0)


class _AttentionLaunch:
    """What the attention kernel's launches of one call share: the sequences' tensors,
    the strides, the dot dtype and the compile-time constants."""

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        pdl: bool,
    ) -> None:
        if q.dtype == torch.float32 or interpret_mode():
            # The interpreter mis-computes 16-bit tl.dot; float32 there is also more exact.
            dot_dtype, precision = tl.float32, "ieee"
        else:
            dot_dtype = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
            precision = "tf32"
        self.q, self.k_cache, self.v_cache, self.out, self.pdl = q, k_cache, v_cache, out, pdl
        self.block_tables, self.query_start_loc = block_tables, query_start_loc
        self.block_size = k_cache.shape[1]
        self.KVH, self.Dh = k_cache.shape[2], q.shape[2]
        self.heads_per_kv = q.shape[1] // self.KVH
        self.block_d = max(16, next_pow2(self.Dh))  # tl.dot needs dims >= 16 on the GPU
        self.args = (block_tables, query_start_loc, seq_lens, float(scale) * math.log2(math.e))
        self.strides = (
            self.Dh,
            self.block_size,
            sliding_window or 0,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *out.stride(),
            *block_tables.stride(),
        )
        self.meta = dict(
            HEADS_PER_KV=self.heads_per_kv,
            HAS_WINDOW=sliding_window is not None,
            BLOCK_D=self.block_d,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=precision,
        )

    def decode_config(
        self, num_decodes: int, decode_config: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """The decode path's launch parameters (`decode_launch_config`) for this call."""
        max_context = self.block_tables.shape[1] * self.block_size
        return decode_launch_config(
            num_decodes, self.KVH, self.heads_per_kv, self.Dh, max_context, self.q.device,
            decode_config, self.pdl,
        )  # fmt: skip

    def decode(
        self, num_decodes: int, cfg: Mapping[str, Any], rope: tuple[Any, ...] = _NO_ROPE
    ) -> None:
        """The decode path over the first `num_decodes` sequences (and the merge of its
        splits) with launch parameters `cfg` (`decode_config`); `rope`: the kernel's RoPE
        arguments, to rotate q and write this step's K/V in the same launch
        (`rotary_decode_attention`, with `prefetch` only)."""
        q, out, KVH, H = self.q, self.out, self.KVH, self.q.shape[1]
        splits = cfg["num_splits"]
        part_out = part_lse = out  # not touched with one split
        if splits > 1:
            part_out = q.new_empty(num_decodes, H, splits, self.block_d, dtype=torch.float32)
            part_lse = q.new_empty(num_decodes, H, splits, dtype=torch.float32)
        _paged_attention_kernel[(num_decodes, KVH, splits)](
            q,
            self.k_cache,
            self.v_cache,
            out,
            part_out,
            part_lse,
            *self.args,
            0,
            num_decodes,
            0,
            splits,
            *self.strides,
            *rope,
            BLOCK_Q=1,
            SPLIT_KV=splits > 1,
            SEARCH_SEQS=False,
            BLOCK_M=cfg["block_m"],
            BLOCK_N=cfg["block_n"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **self.meta,
            PDL=self.pdl,
            PREFETCH=cfg["prefetch"],
            MASK_SKIP=cfg["mask_skip"],
            ROPE=rope[0] is not None,
            **pdl_launch(self.pdl),
        )
        if splits > 1:
            _merge_splits_kernel[(num_decodes, H)](
                out,
                part_out,
                part_lse,
                self.query_start_loc,
                splits,
                self.Dh,
                *out.stride(),
                # The splits' cap (a fixed tile, not one per split count), or above it.
                BLOCK_S=max(_MAX_SPLITS, next_pow2(splits)),
                BLOCK_D=self.block_d,
                PDL=self.pdl,
                **pdl_launch(self.pdl),
            )
