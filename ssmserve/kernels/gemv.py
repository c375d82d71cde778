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

`gemv_act_and_mul` is a gated MLP's gate_up projection and its act(gate) * up in one
launch: a program's tile rows pair gate row j with up row j (the weight is gate's rows,
then up's), so it streams the same bytes in tiles of the same shape as the GEMV of the
whole weight, sums each row the same way, and stores act(gate) * up instead of both.
Every value is rounded as the GEMV and `act_and_mul` round theirs, so it gives their
result bit for bit, and a launch and the [1, 2I] round trip fewer per layer.

benchmarks/kernels/bench_pdl.py measures it against F.linear in decode-shaped chains.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    act_and_mul_tile,
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
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [1, K], weight [N, K] (nn.Linear's layout), bias [N] or None -> x weight^T +
    bias, [1, N] in x's dtype: exactly F.linear; with `out_dtype`, that result cast to it
    (an LM head's float32 logits). `pdl` is the Triton launcher's."""
    _check_gemv_args(x, weight, bias)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def _check_gemv_act_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str
) -> tuple[int, int, int]:
    """Validate a gated GEMV's arguments; return (2I, K, I)."""
    N, K = _check_gemv_args(x, weight, bias)
    _, inter = _check_act_args(x.new_empty(0, N), act)
    return N, K, inter


def gemv_act_and_mul_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str,
    pdl: bool = False,
) -> torch.Tensor:
    """x [1, K], weight [2I, K] (gate's rows, then up's), bias [2I] or None ->
    act(gate) * up, [1, I] in x's dtype: `act_and_mul` of F.linear. `pdl` is the Triton
    launcher's."""
    _check_gemv_act_args(x, weight, bias, act)
    return act_and_mul_ref(F.linear(x, weight, bias), act=act)


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
    default = {
        "block_k": block_k,
        "block_tile": 8192,
        "num_warps": 4,
    }
    cfg = launch_config("gemv", default, config)
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
def _x_tile(x_ptr, ks, K, EVEN_K: tl.constexpr):
    # The input's columns `ks` (past K: zeros).
    if EVEN_K:
        return tl.load(x_ptr + ks)
    return tl.load(x_ptr + ks, mask=ks < K, other=0.0)


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
    ACT: tl.constexpr,
    PDL: tl.constexpr,
):
    # ACT < 0: y = x W^T + b, N rows. ACT >= 0 (an activation code): out = act(gate) *
    # up with N = I, the tile's rows interleaved: row 2i is gate row j, 2i + 1 up row j
    # (weight row j + N), for the BLOCK_N // 2 outputs j of the program.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if ACT < 0:
        offs_n = pid * BLOCK_N + offs
        # Rows past N read the last row (in bounds, unmasked); their sums are not stored.
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    else:
        rows = (tl.minimum(pid * (BLOCK_N // 2) + offs // 2, N - 1) + (offs % 2) * N).to(tl.int64)
    # The first weight tile before the PDL wait (no kernel writes the weights).
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if PDL:
        gdc_launch_dependents()
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
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K))
        else:
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=(ks + BLOCK_K)[None, :] < K, other=0.0)
        x = _x_tile(x_ptr, ks, K, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = w_next
    ks = tl.cdiv(K, BLOCK_K) * BLOCK_K - BLOCK_K + offs_k
    x = _x_tile(x_ptr, ks, K, EVEN_K)
    acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    # Rounded to x's dtype as F.linear rounds, then stored in out's (float32 logits).
    y = y.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    if ACT < 0:
        tl.store(out_ptr + offs_n, y, mask=offs_n < N)
    else:
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        offs_out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + offs_out, act_and_mul_tile(gate, up, ACT), mask=offs_out < N)


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    act: str | None,
    pdl: bool,
    config: Mapping[str, Any] | None,
) -> torch.Tensor:
    """`out` = the GEMV of x (or act(gate) * up of it, with `act`)."""
    N, K = weight.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("gemv needs the weight's rows contiguous (nn.Linear's layout)")
    cfg = gemv_launch_config(N, K, x.device, config)
    # A gated program's tile holds its output rows' gate and up rows: at least one pair.
    block_n = cfg["block_n"] if act is None else max(2, cfg["block_n"])
    _gemv_kernel[(cdiv(N, block_n),)](
        x,
        weight,
        bias,
        out,
        N if act is None else N // 2,
        K,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=cfg["block_k"],
        EVEN_K=K % cfg["block_k"] == 0,
        ACT=-1 if act is None else ACT_CODES[act],
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return out


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `gemv_ref` (same arguments and shapes; the sum in another order,
    rounded once to x's dtype, stored in `out_dtype`'s). `pdl`: launch with programmatic
    dependent launch (sm_90)."""
    N, K = _check_gemv_args(x, weight, bias)
    out = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
    if N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias[None])
    return _launch_gemv(x, weight, bias, out, None, pdl, config)


def gemv_act_and_mul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act: str,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `gemv_act_and_mul_ref` (same arguments and shapes): bit for bit
    `act_and_mul_triton` of `gemv_triton` at the same tile shape (`config` is the GEMV's
    for the whole [2I, K] weight; a tile of one row takes two, a gate and an up row)."""
    N, K, inter = _check_gemv_act_args(x, weight, bias, act)
    out = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    if inter == 0:
        return out
    if K == 0:
        gate_up = x.new_zeros(1, N) if bias is None else bias[None].clone()
        return out.copy_(act_and_mul_ref(gate_up, act=act))
    return _launch_gemv(x, weight, bias, out, act, pdl, config)
