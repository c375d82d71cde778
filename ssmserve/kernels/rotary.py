"""Rotary position embedding (neox layout: rotate halves) on the first `rotary_dim` dims.

For token t at position p and frequency i: angle = p * inv_freq[i], cos/sin scaled by
`scaling` and rounded to q's dtype (as transformers does), then

    x[i]        <- x[i] * cos - x[i + half] * sin
    x[i + half] <- x[i + half] * cos + x[i] * sin         (i < half = rotary_dim / 2)

with each product and the sum rounded to the dtype, and the dims past rotary_dim kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ssmserve.kernels._common import (
    check_shape,
    gdc_launch_dependents,
    gdc_wait,
    lazy_jit,
    next_pow2,
    pdl_launch,
    tl,
)
from ssmserve.kernels.paged_attention import (
    _NO_ROPE,
    _AttentionLaunch,
    _check_attention_args,
    _check_kv_write_args,
    paged_attention_ref,
    write_kv_cache_ref,
)


def _check_rotary_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[int, int]:
    check_shape("q", q, [None, None, None])
    T, _, D = q.shape
    check_shape("k", k, [T, None, D])
    check_shape("positions", positions, [T])
    half = inv_freq.shape[0]
    if 2 * half > D:
        raise ValueError(f"rotary_dim {2 * half} exceeds the head dim {D}")
    return T, half


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scaling: float = 1.0,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D], positions [T], inv_freq [rotary_dim / 2] (float32)
    -> rotated q, k (new tensors). With v, k_cache, v_cache and slot_mapping (all or
    none), the rotated k and v are also written to the paged caches, as
    `write_kv_cache` does (the Triton form does it in the same launch)."""
    _check_rotary_args(positions, q, k, inv_freq)
    writes = _check_kv_args(k, v, k_cache, v_cache, slot_mapping)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(q.dtype)[:, None, :]
    sin = (emb.sin() * scaling).to(q.dtype)[:, None, :]
    dim = emb.shape[-1]
    q, k = _rotate(q, cos, sin, dim), _rotate(k, cos, sin, dim)
    if writes:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _check_kv_args(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> bool:
    """Whether the call writes the caches (all four given; none is fine too)."""
    given = [t is not None for t in (v, k_cache, v_cache, slot_mapping)]
    if any(given) and not all(given):
        raise ValueError(
            "rotary_embedding writes the KV cache given v, k_cache, v_cache and "
            "slot_mapping together; pass all four or none"
        )
    if all(given):
        _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    return all(given)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


# ---------------------------------------------------------------------------- Triton


@lazy_jit(do_not_specialize=("pos_ptr", "slot_ptr"))
def _rotary_kernel(
    q_ptr,
    qy_ptr,
    k_ptr,
    ky_ptr,
    pos_ptr,
    freq_ptr,
    num_q_heads,
    half,
    head_dim,
    scaling,
    stride_q_t,
    stride_q_h,
    stride_qy_t,
    stride_qy_h,
    stride_k_t,
    stride_k_h,
    stride_ky_t,
    stride_ky_h,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    block_size,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (token, head), q's heads first, then k's: rotate the first
    # 2 * half dims, copy the rest. With WRITE_KV a k head's program also writes the
    # rotated head and the token's v head into the caches (write_kv_cache's stores).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    is_k = h >= num_q_heads
    if is_k:
        kv_head = h - num_q_heads
        x_row = k_ptr + t * stride_k_t + kv_head * stride_k_h
        y_row = ky_ptr + t * stride_ky_t + kv_head * stride_ky_h
    else:
        kv_head = h * 0
        x_row = q_ptr + t * stride_q_t + h * stride_q_h
        y_row = qy_ptr + t * stride_qy_t + h * stride_qy_h
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    if PDL:
        gdc_launch_dependents()
    # Before the wait, what no kernel of the step writes: the frequencies, the position
    # and the cache slot (the step's inputs). After it every load comes before the first
    # store: the compiler keeps a load below a store that may alias, a round trip more.
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + offs, mask=mask, other=0.0)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        write = is_k & (slot >= 0)
        offs_d = tl.arange(0, BLOCK_D)
        keep_d = (offs_d < head_dim) & write
    if PDL:
        gdc_wait()
    a = tl.load(x_row + offs, mask=mask, other=0.0)
    b = tl.load(x_row + half + offs, mask=mask, other=0.0)
    if BLOCK_REST > 0:
        rest = 2 * half + tl.arange(0, BLOCK_REST)
        keep = rest < head_dim
        kept = tl.load(x_row + rest, mask=keep, other=0.0)
    if WRITE_KV:
        v_row = v_ptr + t * stride_v_t + kv_head * stride_v_h
        vals = tl.load(v_row + offs_d, mask=keep_d, other=0.0)
    dtype = a.dtype
    cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    # Round each product and the sum as the PyTorch twin does in the model dtype.
    ra = ((af * cos).to(dtype).to(tl.float32) - (bf * sin).to(dtype).to(tl.float32)).to(dtype)
    rb = ((bf * cos).to(dtype).to(tl.float32) + (af * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(y_row + offs, ra, mask=mask)
    tl.store(y_row + half + offs, rb, mask=mask)
    if BLOCK_REST > 0:
        tl.store(y_row + rest, kept, mask=keep)
    if WRITE_KV:
        kc_row = kc_ptr + (slot // block_size) * stride_kc_b + (slot % block_size) * stride_kc_o
        kc_row += kv_head * stride_kc_h
        kc_dtype = kc_ptr.dtype.element_ty
        tl.store(kc_row + offs, ra.to(kc_dtype), mask=mask & write)
        tl.store(kc_row + half + offs, rb.to(kc_dtype), mask=mask & write)
        if BLOCK_REST > 0:
            tl.store(kc_row + rest, kept.to(kc_dtype), mask=keep & write)
        vc_row = vc_ptr + (slot // block_size) * stride_vc_b + (slot % block_size) * stride_vc_o
        vc_row += kv_head * stride_vc_h
        tl.store(vc_row + offs_d, vals.to(vc_ptr.dtype.element_ty), mask=keep_d)


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scaling: float = 1.0,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `rotary_embedding_ref` (same arguments, shapes and result): q and k
    in one launch, and the cache write in it too where asked."""
    T, half = _check_rotary_args(positions, q, k, inv_freq)
    writes = _check_kv_args(k, v, k_cache, v_cache, slot_mapping)
    Hq, Hk, D = q.shape[1], k.shape[1], q.shape[2]
    qy = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ky = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return qy, ky
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    if writes:
        v = v if v.stride(2) == 1 else v.contiguous()
        if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
            raise ValueError("the KV caches' head dims must be contiguous")
    rest = D - 2 * half
    cache_args = (
        (v, k_cache, v_cache, slot_mapping, k_cache.shape[1], *v.stride()[:2],
         *k_cache.stride()[:3], *v_cache.stride()[:3])
        if writes
        else (None, None, None, None, 1, 0, 0, 0, 0, 0, 0, 0, 0)
    )  # fmt: skip
    _rotary_kernel[(T, Hq + Hk)](
        q,
        qy,
        k,
        ky,
        positions,
        inv_freq,
        Hq,
        half,
        D,
        float(scaling),
        q.stride(0),
        q.stride(1),
        qy.stride(0),
        qy.stride(1),
        k.stride(0),
        k.stride(1),
        ky.stride(0),
        ky.stride(1),
        *cache_args,
        BLOCK_HALF=next_pow2(half),
        BLOCK_REST=next_pow2(rest) if rest else 0,
        BLOCK_D=next_pow2(D),
        WRITE_KV=writes,
        num_warps=1,
        PDL=pdl,
        **pdl_launch(pdl),
    )
    return qy, ky


# ------------------------------------------------------- RoPE inside decode attention


def _check_decode_args(q: torch.Tensor, query_start_loc: torch.Tensor) -> int:
    """Every sequence of the call decodes: one query each."""
    T = q.shape[0]
    if query_start_loc.shape != (T + 1,):
        raise ValueError(
            "rotary_decode_attention takes decodes only, one query a sequence: "
            f"query_start_loc must have {T + 1} entries for {T} queries, got "
            f"{tuple(query_start_loc.shape)}"
        )
    return T


def rotary_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float = 1.0,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """A decode step's attention from its projections: `rotary_embedding` of q [T, H, D]
    and k [T, KVH, D] at `positions`, with this step's k and v [T, KVH, D] written to the
    caches at `slot_mapping`, then `paged_attention` of every sequence's one query (T
    sequences, `num_decodes` = T). Returns [T, H, D] in q's dtype."""
    T = _check_decode_args(q, query_start_loc)
    q, _ = rotary_embedding_ref(
        positions, q, k, inv_freq, scaling=scaling,
        v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
    )  # fmt: skip
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables=block_tables, query_start_loc=query_start_loc,
        seq_lens=seq_lens, scale=scale, sliding_window=sliding_window, num_decodes=T,
    )  # fmt: skip


def rotary_decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float = 1.0,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    decode_config: Mapping[str, Any] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton twin of `rotary_decode_attention_ref`: `rotary_embedding_triton` then
    `paged_attention_triton`, in one launch where the decode attention reads each split's
    first key tile before its wait (`prefetch`: with PDL, few tiles a split, as at batch
    1): its programs rotate their query heads, and the one holding a sequence's own
    position rotates the key and writes it and the value to the caches. Elsewhere the
    two launches. `decode_config` overrides the decode launch parameters as
    `paged_attention_triton`'s does."""
    T = _check_decode_args(q, query_start_loc)
    _, half = _check_rotary_args(positions, q, k, inv_freq)
    _check_kv_write_args(k, v, k_cache, v_cache, slot_mapping)
    _check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, T)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    launch = _AttentionLaunch(
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
        sliding_window, pdl,
    )  # fmt: skip
    cfg = launch.decode_config(T, decode_config)
    if cfg["prefetch"]:
        rope = (
            k, v, positions, inv_freq, slot_mapping, half, float(scaling),
            *k.stride()[:2], *v.stride()[:2],
        )  # fmt: skip
    else:
        # Without prefetch a split walks many tiles in a pipelined loop, beside which the
        # kernel would hold the own key and its rotation at twice the registers (253
        # against 128 a thread at batch 64, sm_90, 4 warps): half the programs an SM.
        q, _ = rotary_embedding_triton(
            positions, q, k, inv_freq, scaling=scaling,
            v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, pdl=pdl,
        )  # fmt: skip
        launch = _AttentionLaunch(
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scale,
            sliding_window, pdl,
        )  # fmt: skip
        rope = _NO_ROPE
    launch.decode(T, cfg, rope)
    return out
