"""GEMV for one row: y = x W^T + b, as F.linear computes it, for batch-1 decode.

A batch-1 decode step reads every weight once, a linear at a time, each waiting for the
kernel before it. cuBLAS reads the small ones well below bandwidth (its ramp and tail:
Mamba2-2.7B's out_proj at 1.7x its floor). This kernel is written for programmatic
dependent launch (`pdl=True`): a program loads its first weight tile (16 KB) before
`gdc_wait()`, while the kernel before it still runs, and reads x only after it.

- A program owns `block_n` weight rows and walks K in `block_k`-column tiles (K is
  contiguous in nn.Linear's [N, K] layout, so each thread issues 16-byte loads), the
  next tile's load issued before the current one's multiply; the products accumulate
  elementwise in float32 and are summed across the tile once at the end.
- `block_k` is the largest power of two up to 4096 dividing K (then no masks), and
  `block_n` holds `block_tile` weight elements a program (8192: 16 KB of bf16).

benchmarks/kernels/bench_pdl.py measures it against F.linear in decode-shaped chains.

`gated_rms_norm_gemv` and `add_rms_norm_gemv` are the GEMV with the RMSNorm before it
(Mamba2's gated norm before out_proj; a block's residual add and pre-norm before its
first linear) computed inside: at batch 1 the norm's own kernel is a single program on
the step's critical path (2-2.5 us a layer on an H100). Each program reads the whole
input row anyway; it accumulates the squares of each norm group beside the products
and scales the group's partial sums by its 1/rms at the group's end. So the normalised
row is never rounded to the model dtype before the multiply, as the unfused norm rounds
it: the result differs from norm-then-GEMV by that one rounding (in bf16, about 2^-9 of
each input, averaged over K), and not at all in float32 beyond the order of the sums.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    cdiv,
    check_shape,
    gdc_launch_dependents,
    gdc_wait,
    launch_config,
    lazy_jit,
    next_pow2,
    num_sms,
    pdl_launch,
    tl,
)
from ssmserve.kernels.gated_rms_norm import (
    _check_add_norm_args,
    _check_norm_args,
    add_rms_norm_ref,
    add_rms_norm_triton,
    gated_rms_norm_ref,
    gated_rms_norm_triton,
)


def _check_gemv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int]:
    check_shape("x", x, [1, None])
    K = x.shape[1]
    check_shape("weight", weight, [None, K])
    N = weight.shape[0]
    if bias is not None:
        check_shape("bias", bias, [N])
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError("x, weight and bias must share one dtype")
    return N, K


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """x [1, K], weight [N, K] (nn.Linear's layout), bias [N] or None -> x weight^T +
    bias, [1, N] in x's dtype: exactly F.linear. `pdl` is the Triton launcher's."""
    _check_gemv_args(x, weight, bias)
    return F.linear(x, weight, bias)


def gemv_launch_config(
    N: int, K: int, device: torch.device, config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """block_k (a power of two: the largest up to 4096 dividing K, else K's next power of
    two capped at 4096), block_tile (weight elements a program holds per step; block_n =
    block_tile // block_k rows, halved while that leaves under two programs an SM: a
    narrow weight such as Mamba's x_proj, 192 rows, still spreads over the GPU),
    num_warps: 4, the fastest of bench_pdl.py's sweep on the H100 (2026-12-06: Mamba2-2.7B
    chain 2.42 ms against 2.52 with 8; Llama-3-8B MLP 3.82 against 3.83).

    Unless block_tile is given, a weight that would make under six programs an SM takes
    half the rows a program: more programs in flight hide each one's ramp and tail. On
    the H100 (2026-12-06, bench_pdl, num_warps 4) half the tile took the Mamba2-2.7B chain
    (in_proj 661 programs, out_proj 320) from 2.47 to 2.24 ms, and the Llama MLP chain
    (14336 and 1024 programs, untouched by this rule) from 3.84 to 3.89."""
    block_k = 4096
    while block_k > 16 and K % block_k:
        block_k //= 2
    if K % block_k:
        block_k = min(next_pow2(K), 4096)
    cfg = launch_config("gemv", {"block_k": block_k, "block_tile": 8192, "num_warps": 4}, config)
    block_n = max(1, cfg["block_tile"] // cfg["block_k"])
    # The interpreter has no SMs; a small stand-in lets CPU tests reach the halving.
    sms = num_sms(device) if device.type == "cuda" else 2
    if block_n > 1 and cdiv(N, block_n) < 6 * sms and "block_tile" not in (config or {}):
        block_n //= 2
    while block_n > 1 and cdiv(N, block_n) < 2 * sms:
        block_n //= 2
    cfg["block_n"] = block_n
    return cfg


@lazy_jit(do_not_specialize=["N"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N read the last row (in bounds, unmasked); their sums are not stored.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if PDL:
        gdc_launch_dependents()
    # The first tile, before the wait: no kernel writes the weights.
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)
    if PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K - BLOCK_K, BLOCK_K):
        # Every tile but the last, the next one's load issued before this one's multiply.
        ks = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_ptr + ks)
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K))
        else:
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=(ks + BLOCK_K)[None, :] < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = w_next
    ks = tl.cdiv(K, BLOCK_K) * BLOCK_K - BLOCK_K + offs_k
    if EVEN_K:
        x = tl.load(x_ptr + ks)
    else:
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
    acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `gemv_ref` (same arguments and shapes; the sum in another order,
    rounded once). `pdl`: launch with programmatic dependent launch (sm_90)."""
    N, K = _check_gemv_args(x, weight, bias)
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias[None])
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (nn.Linear's layout)")
    cfg = gemv_launch_config(N, K, x.device, config)
    _gemv_kernel[(cdiv(N, cfg["block_n"]),)](
        x,
        weight,
        bias,
        out,
        N,
        K,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        EVEN_K=K % cfg["block_k"] == 0,
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return out


# ------------------------------------------------------------------- norm, then GEMV


def gated_rms_norm_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor,
    z: torch.Tensor | None,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """F.linear(gated_rms_norm(x, norm_weight, z, ...), weight, bias) for one row x
    [1, K]: the GEMV's arguments, then the norm's (see `gated_rms_norm_ref`). `pdl` is
    the Triton launcher's."""
    h = gated_rms_norm_ref(
        x, norm_weight, z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate
    )
    _check_gemv_args(h, weight, bias)
    return F.linear(h, weight, bias)


def add_rms_norm_gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(h, weight, bias), s) for (h, s) = add_rms_norm(x, residual,
    norm_weight): a block's residual add and pre-norm, then its first linear, for one
    row [1, K]: the GEMV's arguments, then the norm's. `pdl` is the Triton launcher's."""
    h, s = add_rms_norm_ref(x, residual, norm_weight, eps=eps)
    _check_gemv_args(h, weight, bias)
    return F.linear(h, weight, bias), s


def norm_gemv_launch_config(
    N: int, group_size: int, device: torch.device, config: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The GEMV's launch parameters (`gemv_launch_config`) with K tiles that divide the
    norm group (None when no power of two from 16 does: the launcher then runs the norm
    and the GEMV apart), and at most 1024 columns a tile: every program reads the whole
    input row (and the residual or gate and the norm weight) from L2, so a program
    takes at least 8 weight rows, a third of its bytes at most."""
    cfg = dict(config or {})
    if "block_k" not in cfg:
        block_k = 1024
        while block_k >= 16 and group_size % block_k:
            block_k //= 2
        cfg["block_k"] = block_k
    if cfg["block_k"] < 16 or group_size % cfg["block_k"]:
        return None
    return gemv_launch_config(N, group_size, device, cfg)


@lazy_jit(do_not_specialize=["N"])
def _norm_gemv_kernel(
    x_ptr,
    gate_ptr,
    residual_ptr,
    sum_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    group_size,
    eps,
    stride_wn,
    GATED: tl.constexpr,  # h = x * silu(gate); else h = residual + x, stored to sum_ptr
    HAS_GATE: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # As _gemv_kernel (BLOCK_K divides group_size, which divides K: no K masks), with
    # the input row normalised on the fly: per norm group, the products of h * norm_w
    # and the squares of h accumulate apart, and the group's row sums are scaled by its
    # 1/rms once at the group's end.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if PDL:
        gdc_launch_dependents()
    # The first tile, before the wait: no kernel writes the weights.
    w = tl.load(w_ptrs)
    if PDL:
        gdc_wait()
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k_group in range(0, K, group_size):
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(k_group, k_group + group_size, BLOCK_K):
            ks = k0 + offs_k
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=(ks + BLOCK_K)[None, :] < K, other=0.0)
            x = tl.load(x_ptr + ks)
            if GATED:
                h = x.to(tl.float32)
                if HAS_GATE:
                    zv = tl.load(gate_ptr + ks).to(tl.float32)
                    gate = zv / (1.0 + tl.exp(-zv))
                    if NORM_BEFORE_GATE:
                        squares += h * h
                        h = h * gate
                    else:
                        h = h * gate
                        squares += h * h
                else:
                    squares += h * h
            else:
                # The sum as add_rms_norm rounds it (the residual's dtype), then as the
                # norm reads it (the norm weight's); one program stores it.
                r = tl.load(residual_ptr + ks)
                s = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
                tl.store(sum_ptr + ks, s, mask=(ks < K) & (pid == 0))
                h = s.to(norm_w_ptr.dtype.element_ty).to(tl.float32)
                squares += h * h
            nw = tl.load(norm_w_ptr + ks).to(tl.float32)
            acc += w.to(tl.float32) * (h * nw)[None, :]
            w = w_next
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / group_size + eps)
        y += tl.sum(acc, axis=1) * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _launch_norm_gemv(
    cfg, x, gate, residual, s, norm_weight, weight, bias, group, gated, norm_before_gate,
    eps, pdl,
) -> torch.Tensor:  # fmt: skip
    N, K = weight.shape
    out = torch.empty(1, N, dtype=weight.dtype, device=x.device)
    _norm_gemv_kernel[(cdiv(N, cfg["block_n"]),)](
        x,
        gate,
        residual,
        s,
        norm_weight,
        weight,
        bias,
        out,
        N,
        K,
        group,
        float(eps),
        weight.stride(0),
        GATED=gated,
        HAS_GATE=gate is not None,
        NORM_BEFORE_GATE=norm_before_gate,
        HAS_BIAS=bias is not None,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return out


def _contiguous_rows(weight: torch.Tensor, *vectors: torch.Tensor | None) -> list:
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (nn.Linear's layout)")
    return [v if v is None or v.is_contiguous() else v.contiguous() for v in vectors]


def gated_rms_norm_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor,
    z: torch.Tensor | None,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `gated_rms_norm_gemv_ref` (same arguments and shapes; the norm
    inside the GEMV's one launch, see the module docstring for how it rounds). Where
    no tile divides the norm group, the norm and the GEMV run as two kernels. `pdl`:
    launch with programmatic dependent launch (sm_90)."""
    _, K, group = _check_norm_args(x, norm_weight, z, group_size)
    check_shape("x", x, [1, K])
    N, _ = _check_gemv_args(x, weight, bias)
    cfg = norm_gemv_launch_config(N, group, x.device, config)
    if cfg is None or N == 0:
        h = gated_rms_norm_triton(
            x, norm_weight, z, eps=eps, group_size=group_size,
            norm_before_gate=norm_before_gate, pdl=pdl,
        )  # fmt: skip
        return gemv_triton(h, weight, bias, pdl=pdl)
    x, z = _contiguous_rows(weight, x, z)
    return _launch_norm_gemv(
        cfg, x, z, None, None, norm_weight, weight, bias, group, True, norm_before_gate,
        eps, pdl,
    )  # fmt: skip


def add_rms_norm_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `add_rms_norm_gemv_ref` (same arguments, shapes and sum; the norm
    inside the GEMV's one launch, see the module docstring for how it rounds). `pdl`:
    launch with programmatic dependent launch (sm_90)."""
    _, K = _check_add_norm_args(x, residual, norm_weight)
    check_shape("x", x, [1, K])
    check_shape("weight", weight, [None, K])
    N = weight.shape[0]
    if bias is not None:
        check_shape("bias", bias, [N])
    if weight.dtype != norm_weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError("norm_weight, weight and bias must share one dtype")
    cfg = norm_gemv_launch_config(N, K, x.device, config)
    if cfg is None or N == 0:
        h, s = add_rms_norm_triton(x, residual, norm_weight, eps=eps, pdl=pdl)
        return gemv_triton(h, weight, bias, pdl=pdl), s
    x, residual = _contiguous_rows(weight, x, residual)
    s = torch.empty_like(residual)
    y = _launch_norm_gemv(
        cfg, x, None, residual, s, norm_weight, weight, bias, K, False, False, eps, pdl
    )
    return y, s


def gated_rms_norm_then_gemv(
    norm: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor,
    z: torch.Tensor | None,
    **norm_args: Any,
) -> torch.Tensor:
    """`gated_rms_norm_gemv` as two kernels: `norm` (a gated_rms_norm), then F.linear.
    What the op runs outside CUDA graphs, where the GEMV does not pay (see get_ops)."""
    return F.linear(norm(x, norm_weight, z, **norm_args), weight, bias)


def add_rms_norm_then_gemv(
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    **norm_args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_gemv` as two kernels: `add_norm` (an add_rms_norm), then F.linear."""
    h, s = add_norm(x, residual, norm_weight, **norm_args)
    return F.linear(h, weight, bias), s
