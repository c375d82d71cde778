"""Gated, optionally grouped RMSNorm used after the Mamba2 scan.

norm_before_gate=False (Mamba2 / Bamba):  y = weight * rmsnorm(x * silu(z))
norm_before_gate=True:                    y = weight * rmsnorm(x) * silu(z)

rmsnorm normalises each group of `group_size` consecutive channels (the whole row
when None) in float32.

`add_rms_norm` is the pre-norm residual step of Mamba-style blocks in one pass: the
residual stream takes the previous block's output, and the next block's RMSNorm reads
the sum, rounded as the unfused code rounds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    check_shape,
    gdc_launch_dependents,
    gdc_wait,
    lazy_jit,
    next_pow2,
    pdl_launch,
    tl,
)


def _check_norm_args(
    x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, group_size: int | None
) -> tuple[int, int, int]:
    check_shape("x", x, [None, None])
    T, Dm = x.shape
    check_shape("weight", weight, [Dm])
    if z is not None:
        check_shape("z", z, [T, Dm])
    group = Dm if group_size is None else group_size
    if group <= 0 or Dm % group != 0:
        raise ValueError(f"group_size ({group_size}) must divide the hidden size ({Dm})")
    return T, Dm, group


def gated_rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """Gated grouped RMSNorm in PyTorch (`pdl` is the Triton launcher's).

    Matches Hugging Face's BambaRMSNormGated / MambaRMSNormGated exactly when
    group_size is None and norm_before_gate is False: the normalised value is cast to
    x.dtype before the weight multiply.

    Args:
        x: [T, Dm]. weight: [Dm]. z: [T, Dm] gate or None.
        eps: added to the mean square. group_size: channels per group (None = Dm).

    Returns:
        y: [T, Dm] in x.dtype.
    """
    T, Dm, group = _check_norm_args(x, weight, z, group_size)
    dtype = x.dtype
    h = x.float()
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.float())
    h = h.view(T, Dm // group, group)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.view(T, Dm)
    if z is not None and norm_before_gate:
        h = h * F.silu(z.float())
    return (weight * h.to(dtype)).to(dtype)


# ---------------------------------------------------------------------------- Triton


@lazy_jit
def _gated_rms_norm_kernel(
    x_ptr,
    weight_ptr,
    z_ptr,
    y_ptr,
    group_size,
    eps,
    stride_x_t,
    stride_x_c,
    stride_z_t,
    stride_z_c,
    stride_y_t,
    stride_y_c,
    HAS_Z: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    if PDL:
        gdc_launch_dependents()
    # The weight before the wait: no kernel writes it.
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x_t + offs * stride_x_c, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + row * stride_z_t + offs * stride_z_c, mask=mask, other=0.0)
        z = z.to(tl.float32)
        gate = z / (1.0 + tl.exp(-z))
        if not NORM_BEFORE_GATE:
            h = h * gate
    h = h / tl.sqrt(tl.sum(h * h, axis=0) / group_size + eps)
    # Round the normalised value to the input dtype before the weight multiply, as
    # Hugging Face does: outputs then match it bit for bit.
    h = h.to(x.dtype).to(tl.float32)
    out = w * h
    if HAS_Z:
        if NORM_BEFORE_GATE:
            out = out * gate
    tl.store(
        y_ptr + row * stride_y_t + offs * stride_y_c, out.to(y_ptr.dtype.element_ty), mask=mask
    )


def gated_rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton twin of `gated_rms_norm_ref` (same arguments, shapes and result). `pdl`:
    launch with programmatic dependent launch (sm_90)."""
    T, Dm, group = _check_norm_args(x, weight, z, group_size)
    y = torch.empty_like(x)
    if T == 0:
        return y
    block = next_pow2(group)
    grid = (T, Dm // group)
    _gated_rms_norm_kernel[grid](
        x,
        weight,
        z,
        y,
        group,
        float(eps),
        *x.stride(),
        *(z.stride() if z is not None else (0, 0)),
        *y.stride(),
        HAS_Z=z is not None,
        NORM_BEFORE_GATE=norm_before_gate,
        BLOCK=block,
        PDL=pdl,
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch(pdl),
    )
    return y


# ---------------------------------------------------------------------------- add + norm


def _check_add_norm_args(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> tuple[int, int]:
    check_shape("x", x, [None, None])
    T, H = x.shape
    check_shape("residual", residual, [T, H])
    check_shape("weight", weight, [H])
    return T, H


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    cast_sum: bool = True,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s.to(weight.dtype)), s) for s = residual + x in residual's dtype.

    The same values as `s = residual + x` followed by the RMSNorm of `s` cast to the
    weight's dtype (float32 statistics; the normalised value rounded to that dtype
    before the weight multiply), as Hugging Face's Mamba and Mamba2 blocks compute it.
    With `cast_sum=False`, the RMSNorm of `s` itself (the normalised value rounded to s's
    dtype before the weight multiply), cast to the weight's dtype: a Mamba model's final
    norm of its float32 residual, then the cast before the LM head. x: [T, H] (a block's
    output); residual: [T, H]; weight: [H]. `pdl` is the Triton launcher's.
    """
    _check_add_norm_args(x, residual, weight)
    s = residual + x
    if s.dtype != residual.dtype:
        s = s.to(residual.dtype)
    n = s.to(weight.dtype) if cast_sum else s  # the norm's input, in its dtype
    h = n.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(n.dtype)).to(weight.dtype), s


def _check_embed_norm_args(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor
) -> tuple[int, int]:
    check_shape("ids", ids, [None])
    check_shape("table", table, [None, None])
    H = table.shape[1]
    check_shape("weight", weight, [H])
    return ids.shape[0], H


def embed_rms_norm_ref(
    ids: torch.Tensor,
    table: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    sum_dtype: torch.dtype,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(e.to(weight.dtype)), e.to(sum_dtype)) for e = table[ids]: a Mamba
    model's first block, which norms the embedding and starts its residual stream from
    it (float32 with residual_in_fp32), as `add_rms_norm` with a residual of zeros.
    ids: [T] int; table: [V, H] (the embedding, whole); weight: [H]."""
    _check_embed_norm_args(ids, table, weight)
    x = F.embedding(ids, table)
    return add_rms_norm_ref(x, x.new_zeros(x.shape, dtype=sum_dtype), weight, eps=eps)


@lazy_jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    ids_ptr,
    weight_ptr,
    y_ptr,
    sum_ptr,
    hidden,
    eps,
    stride_x_t,
    stride_r_t,
    stride_y_t,
    stride_s_t,
    CAST_SUM: tl.constexpr,
    EMBED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    if PDL:
        gdc_launch_dependents()
    # The weight before the wait: no kernel writes it.
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if PDL:
        gdc_wait()
    if EMBED:  # x is the embedding table, its row this token's id; no residual
        token = tl.load(ids_ptr + row).to(tl.int64)
        x = tl.load(x_ptr + token * stride_x_t + offs, mask=mask, other=0.0)
        s = x.to(tl.float32).to(sum_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x_t + offs, mask=mask, other=0.0)
        r = tl.load(residual_ptr + row * stride_r_t + offs, mask=mask, other=0.0)
        s = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_s_t + offs, s, mask=mask)
    # The norm's input, and its normalised value, in the weight's dtype or in s's.
    n = s.to(w.dtype) if CAST_SUM else s
    h = n.to(tl.float32)
    h = h / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    out = w.to(tl.float32) * h.to(n.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y_t + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    cast_sum: bool = True,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `add_rms_norm_ref` (same arguments, shapes and result): one kernel
    instead of the add, the cast and the norm. `pdl`: launch with programmatic dependent
    launch (sm_90)."""
    T, H = _check_add_norm_args(x, residual, weight)
    s = torch.empty_like(residual)
    y = torch.empty(T, H, dtype=weight.dtype, device=x.device)
    if T == 0:
        return y, s
    if x.stride(1) != 1 or residual.stride(1) != 1:
        x, residual = x.contiguous(), residual.contiguous()
    _launch_add_rms_norm(x, residual, None, weight, y, s, eps, cast_sum, pdl)
    return y, s


def embed_rms_norm_triton(
    ids: torch.Tensor,
    table: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float,
    sum_dtype: torch.dtype,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `embed_rms_norm_ref` (same arguments and result): the embedding's
    gather, the norm and the residual's copy in one kernel, `add_rms_norm`'s."""
    T, H = _check_embed_norm_args(ids, table, weight)
    s = torch.empty(T, H, dtype=sum_dtype, device=table.device)
    y = torch.empty(T, H, dtype=weight.dtype, device=table.device)
    if T == 0:
        return y, s
    if table.stride(1) != 1:
        table = table.contiguous()
    _launch_add_rms_norm(table, s, ids, weight, y, s, eps, True, pdl)
    return y, s


def _launch_add_rms_norm(x, residual, ids, weight, y, s, eps, cast_sum, pdl) -> None:
    """One program a row of y (`ids` given: x is an embedding table and a row's x is
    x[ids[row]], with no residual)."""
    block = next_pow2(y.shape[1])
    _add_rms_norm_kernel[(y.shape[0],)](
        x,
        residual,
        x if ids is None else ids,
        weight,
        y,
        s,
        y.shape[1],
        float(eps),
        x.stride(0),
        residual.stride(0),
        y.stride(0),
        s.stride(0),
        CAST_SUM=cast_sum,
        EMBED=ids is not None,
        BLOCK=block,
        PDL=pdl,
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch(pdl),
    )
