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

Three ops fuse what comes before a linear into its GEMV, a launch fewer each (the model
runner sets them only with `--decode-fused-gemv`, off until measured faster): the same
kernel computing act(gate) * up as it loads x (`act_mul_gemv`), and a second one whose
programs normalise the row as they stream it (`gated_norm_gemv`: a Mamba2 mixer's gated
norm; `add_norm_gemv`: the residual add and RMSNorm before a block's first linear).

benchmarks/kernels/bench_pdl.py measures them against F.linear in decode-shaped chains.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    cdiv,
    check_shape,
    device_function,
    gdc_launch_dependents,
    gdc_wait,
    launch_config,
    lazy_jit,
    next_pow2,
    num_sms,
    pdl_launch,
    tl,
)
from ssmserve.kernels.activation import (
    ACT_CODES,
    _check_act_args,
    act_and_mul_ref,
    act_and_mul_triton,
    activate,
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


@device_function
def _first_weight_tile(
    w_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # A GEMV program's rows (offs_n; rows past N read the last row, in bounds and
    # unmasked, and their sums are not stored), its weight tile pointers, and its first
    # weight tile, loaded before the PDL wait: no kernel writes the weights.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if PDL:
        gdc_launch_dependents()
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)
    if PDL:
        gdc_wait()
    return offs_n, offs_k, rows, w_ptrs, w


@device_function
def _x_tile(x_ptr, ks, K, EVEN_K: tl.constexpr, ACT: tl.constexpr):
    # x[ks] in float32. With ACT >= 0, x_ptr holds gate ++ up (2K) and the tile is
    # act(gate) * up, rounded as `act_and_mul` rounds it (act, then the product, to x's
    # dtype): the GEMV's input is the value the two launches would pass.
    if EVEN_K:
        x = tl.load(x_ptr + ks)
    else:
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
    if ACT >= 0:
        if EVEN_K:
            u = tl.load(x_ptr + K + ks)
        else:
            u = tl.load(x_ptr + K + ks, mask=ks < K, other=0.0)
        a = activate(x.to(tl.float32), ACT).to(x.dtype).to(tl.float32) * u.to(tl.float32)
        x = a.to(x.dtype)
    return x.to(tl.float32)


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
    ACT: tl.constexpr,  # -1: x as it is; else act_and_mul's code, x being gate ++ up
    PDL: tl.constexpr,
):
    offs_n, offs_k, rows, w_ptrs, w = _first_weight_tile(
        w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, PDL
    )
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K - BLOCK_K, BLOCK_K):
        # Every tile but the last, the next one's load issued before this one's multiply.
        ks = k0 + offs_k
        x = _x_tile(x_ptr, ks, K, EVEN_K, ACT)
        if EVEN_K:
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K))
        else:
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=(ks + BLOCK_K)[None, :] < K, other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    ks = tl.cdiv(K, BLOCK_K) * BLOCK_K - BLOCK_K + offs_k
    acc += w.to(tl.float32) * _x_tile(x_ptr, ks, K, EVEN_K, ACT)[None, :]
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
    return _launch_gemv(x, weight, bias, out, K, -1, pdl, config)


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    K: int,
    act: int,
    pdl: bool,
    config: Mapping[str, Any] | None,
) -> torch.Tensor:
    """`_gemv_kernel` over x (gate ++ up when act >= 0) into out [1, N]."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (nn.Linear's layout)")
    N = weight.shape[0]
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
        ACT=act,
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return out


# ------------------------------------------------------------------ act-and-mul + GEMV


def _check_act_gemv_args(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str
) -> tuple[int, int]:
    check_shape("gate_up", gate_up, [1, None])
    _, inter = _check_act_args(gate_up, act)
    return _check_gemv_args(gate_up[:, :inter], weight, bias)


def act_mul_gemv_ref(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str,
    act_and_mul: Callable[..., torch.Tensor] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """A gated MLP's last two steps for one row: `act_and_mul(gate_up)`, then the down
    projection. `act_and_mul` is the op to use (default: the PyTorch twin; the eager form
    of the fused op passes the backend's); `pdl` is the Triton launcher's. gate_up
    [1, 2I] (gate then up); weight [N, I]; returns [1, N] in gate_up's dtype."""
    _check_act_gemv_args(gate_up, weight, bias, act)
    return F.linear((act_and_mul or act_and_mul_ref)(gate_up, act=act), weight, bias)


def act_mul_gemv_triton(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """`act_mul_gemv_ref` in one kernel: each GEMV program computes act(gate) * up as it
    streams the row (rounded as act_and_mul stores it), one launch where the MLP had two.
    The tiles are the plain GEMV's (capping block_k at 1024 to read gate and up fewer
    times from L2 was slower: bench_pdl's Llama MLP chain, H100)."""
    N, inter = _check_act_gemv_args(gate_up, weight, bias, act)
    out = torch.empty(1, N, dtype=gate_up.dtype, device=gate_up.device)
    if N == 0:
        return out
    if inter == 0:
        return out.zero_() if bias is None else out.copy_(bias[None])
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    if weight.stride(1) != 1:  # as F.linear takes it: the two launches
        return F.linear(act_and_mul_triton(gate_up, act=act), weight, bias)
    return _launch_gemv(gate_up, weight, bias, out, inter, ACT_CODES[act], pdl, config)


# ------------------------------------------------------------------ gated norm + GEMV


def gated_norm_gemv_ref(
    x: torch.Tensor,
    z: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    norm: Callable[..., torch.Tensor] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """The Mamba2 mixer's last two steps for one row: `gated_rms_norm(x, norm_weight, z)`
    rounded to the weight's dtype, then the linear. `norm` is the gated norm op to use
    (default: the PyTorch twin; the eager form of the fused op passes the backend's);
    `pdl` is the Triton launcher's. x, z [1, K]; weight [N, K]; returns [1, N]."""
    norm = norm or gated_rms_norm_ref
    h = norm(x, norm_weight, z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    return F.linear(h.to(weight.dtype), weight, bias)


def gated_norm_gemv_triton(
    x: torch.Tensor,
    z: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """`gated_norm_gemv_ref` in one kernel: each GEMV program normalises the row as it
    streams it (one launch where the mixer had two). The normalised value is not
    rounded to the input dtype before the weight multiply (in float32 the two agree to
    rounding; in 16-bit types this is the more exact of the two). Group sizes no power
    of two from 16 divides run the two unfused ops."""
    check_shape("x", x, [1, None])
    _, K, group = _check_norm_args(x, norm_weight, z, group_size)
    check_shape("weight", weight, [None, K])
    N = weight.shape[0]
    if bias is not None:
        check_shape("bias", bias, [N])
    block_k = _norm_block_k(group)
    if block_k is None or weight.stride(1) != 1:
        return gated_norm_gemv_ref(
            x, z, norm_weight, weight, bias, eps=eps, group_size=group_size,
            norm_before_gate=norm_before_gate, norm=gated_rms_norm_triton,
        )  # fmt: skip
    out = torch.empty(1, N, dtype=weight.dtype, device=weight.device)
    if N == 0:
        return out
    if z is not None and z.stride(1) != 1:
        z = z.contiguous()
    _launch_norm_gemv(
        x, z, None, None, norm_weight, weight, bias, out, group, block_k, eps,
        norm_before_gate, pdl, config,
    )  # fmt: skip
    return out


def _norm_block_k(group: int) -> int | None:
    """The norm GEMVs' K tile: the largest power of two from 16 up to 1024 dividing the
    norm group (at most 1024: block_n rows of an 8192-element tile share each read of
    the row), or None where none does (the ops then run unfused)."""
    block_k = 1024
    while block_k > 16 and group % block_k:
        block_k //= 2
    return None if group % block_k else block_k


def _launch_norm_gemv(
    x: torch.Tensor,
    z: torch.Tensor | None,
    residual: torch.Tensor | None,
    s: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    group: int,
    block_k: int,
    eps: float,
    norm_before_gate: bool,
    pdl: bool,
    config: Mapping[str, Any] | None,
) -> None:
    """`_gated_norm_gemv_kernel` over the row x (residual + x with a residual, which it
    writes to s) into out [1, N]."""
    N, K = weight.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = gemv_launch_config(N, group, weight.device, {"block_k": block_k, **(config or {})})
    if group % cfg["block_k"]:
        raise ValueError(f"block_k {cfg['block_k']} must divide the group ({group})")
    _gated_norm_gemv_kernel[(cdiv(N, cfg["block_n"]),)](
        x,
        z,
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
        HAS_Z=z is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        NORM_BEFORE_GATE=norm_before_gate,
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )


@lazy_jit(do_not_specialize=["N"])
def _gated_norm_gemv_kernel(
    x_ptr,
    z_ptr,
    r_ptr,
    s_ptr,
    nw_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    group,
    eps,
    stride_wn,
    HAS_Z: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # y[n] = sum over groups g of rstd_g * sum_{k in g} W[n, k] v[k], where v = h * nw
    # (times the gate when the norm comes first) and rstd_g = 1 / sqrt(mean_g(h^2) + eps).
    # BLOCK_K divides the group, so each K tile lies in one group: the tile's products
    # and squares add into the group's sums, which are scaled and cleared at its end.
    # With a residual, h is s = residual + x in the residual's dtype, then in the norm
    # weight's (add_rms_norm's roundings), and program 0 writes s out.
    pid = tl.program_id(0)
    offs_n, offs_k, rows, w_ptrs, w = _first_weight_tile(
        w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K, True, PDL
    )
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Products and squares accumulate elementwise, reduced once a group (at its end): a
    # reduction across the program's threads every tile would stall the weight stream.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        # The next tile's load before this one's multiply, off past the row. BLOCK_K
        # divides K, so one scalar says so for the whole tile: a mask per element would
        # keep the compiler from vectorising the weight loads.
        w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=k0 + BLOCK_K < K, other=0.0)
        h = tl.load(x_ptr + ks)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + ks)
            h = (r.to(tl.float32) + h.to(tl.float32)).to(r.dtype)
            tl.store(s_ptr + ks, h, mask=pid == 0)
            h = h.to(nw_ptr.dtype.element_ty)
        h = h.to(tl.float32)
        v = h * tl.load(nw_ptr + ks).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + ks).to(tl.float32)
            gate = z / (1.0 + tl.exp(-z))
            v = v * gate
            if not NORM_BEFORE_GATE:
                h = h * gate
        squares += h * h
        acc += w.to(tl.float32) * v[None, :]
        if (k0 + BLOCK_K) % group == 0:
            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / group + eps)
            y += tl.sum(acc, axis=1) * rstd
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        w = w_next
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


# ------------------------------------------------------------- residual add, norm + GEMV


def add_norm_gemv_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's start for one row: `add_rms_norm(x, residual, norm_weight)`,
    whose output feeds the linear. Returns (the linear's output [1, N], s = residual + x
    in residual's dtype: the new residual stream). `add_norm` is the op to use (default:
    the PyTorch twin; the eager form of the fused op passes the backend's); `pdl` is the
    Triton launcher's. x, residual [1, K]; weight [N, K]."""
    check_shape("x", x, [1, None])
    h, s = (add_norm or add_rms_norm_ref)(x, residual, norm_weight, eps=eps)
    return F.linear(h, weight, bias), s


def add_norm_gemv_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm_gemv_ref` in one kernel (`_gated_norm_gemv_kernel` with one group, no
    gate and the residual add): each GEMV program adds and normalises the row as it
    streams it, and the first writes s, out of place (the others still read the old
    residual). The normalised value is not rounded before the weight multiply, as in
    `gated_norm_gemv_triton`. Widths no power of two from 16 divides run the two ops."""
    check_shape("x", x, [1, None])
    _, K = _check_add_norm_args(x, residual, norm_weight)
    check_shape("weight", weight, [None, K])
    N = weight.shape[0]
    if bias is not None:
        check_shape("bias", bias, [N])
    block_k = _norm_block_k(K)
    if block_k is None or weight.stride(1) != 1:
        h, s = add_rms_norm_triton(x, residual, norm_weight, eps=eps)
        return F.linear(h, weight, bias), s
    out = torch.empty(1, N, dtype=weight.dtype, device=weight.device)
    s = torch.empty_like(residual, memory_format=torch.contiguous_format)
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    if N == 0:
        torch.add(residual, x, out=s)
        return out, s
    _launch_norm_gemv(
        x, None, residual, s, norm_weight, weight, bias, out, K, block_k, eps, False, pdl, config
    )
    return out, s
