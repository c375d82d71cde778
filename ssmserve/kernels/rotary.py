"""Rotary position embedding (neox layout: rotate halves) on the first `rotary_dim` dims.

For token t at position p and frequency i: angle = p * inv_freq[i], cos/sin scaled by
`scaling` and rounded to q's dtype (as transformers does), then

    x[i]        <- x[i] * cos - x[i + half] * sin
    x[i + half] <- x[i + half] * cos + x[i] * sin         (i < half = rotary_dim / 2)

with each product and the sum rounded to the dtype, and the dims past rotary_dim kept.
"""

from __future__ import annotations

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
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D], positions [T], inv_freq [rotary_dim / 2] (float32)
    -> rotated q, k (new tensors)."""
    _check_rotary_args(positions, q, k, inv_freq)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * scaling).to(q.dtype)[:, None, :]
    sin = (emb.sin() * scaling).to(q.dtype)[:, None, :]
    dim = emb.shape[-1]
    return _rotate(q, cos, sin, dim), _rotate(k, cos, sin, dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


# ---------------------------------------------------------------------------- Triton


@lazy_jit(do_not_specialize=("pos_ptr",))
def _rotary_kernel(
    x_ptr,
    y_ptr,
    pos_ptr,
    freq_ptr,
    num_heads,
    half,
    head_dim,
    scaling,
    stride_x_t,
    stride_x_h,
    stride_y_t,
    stride_y_h,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    # One program per (token, head): rotate the first 2 * half dims, copy the rest.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + offs, mask=mask, other=0.0)
    x_row = x_ptr + t * stride_x_t + h * stride_x_h
    y_row = y_ptr + t * stride_y_t + h * stride_y_h
    a = tl.load(x_row + offs, mask=mask, other=0.0)
    b = tl.load(x_row + half + offs, mask=mask, other=0.0)
    dtype = a.dtype
    cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    # Round each product and the sum as the PyTorch twin does in the model dtype.
    ra = (af * cos).to(dtype).to(tl.float32) - (bf * sin).to(dtype).to(tl.float32)
    rb = (bf * cos).to(dtype).to(tl.float32) + (af * sin).to(dtype).to(tl.float32)
    tl.store(y_row + offs, ra.to(dtype), mask=mask)
    tl.store(y_row + half + offs, rb.to(dtype), mask=mask)
    if BLOCK_REST > 0:
        rest = 2 * half + tl.arange(0, BLOCK_REST)
        keep = rest < head_dim
        tl.store(y_row + rest, tl.load(x_row + rest, mask=keep, other=0.0), mask=keep)


def _rotate_triton(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    pdl: bool = False,
) -> torch.Tensor:
    T, H, D = x.shape
    half = inv_freq.shape[0]
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    if x.stride(2) != 1:
        x = x.contiguous()
    rest = D - 2 * half
    _rotary_kernel[(T, H)](
        x,
        y,
        positions,
        inv_freq,
        H,
        half,
        D,
        float(scaling),
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_HALF=next_pow2(half),
        BLOCK_REST=next_pow2(rest) if rest else 0,
        num_warps=1,
        PDL=pdl,
        **pdl_launch(pdl),
    )
    return y


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scaling: float = 1.0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `rotary_embedding_ref` (same arguments, shapes and result)."""
    _check_rotary_args(positions, q, k, inv_freq)
    return (
        _rotate_triton(q, positions, inv_freq, scaling, pdl),
        _rotate_triton(k, positions, inv_freq, scaling, pdl),
    )
