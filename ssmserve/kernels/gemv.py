"""GEMV (skinny GEMM): y = x W^T + b for inputs of a few rows, as F.linear computes it.

Batch-1 decode is bound by weight reads. This kernel streams each weight row once from
memory at close to bandwidth, whatever the few rows of x:

- Programs own `block_n` weight rows each (grid: row tiles x K splits) and walk K in
  `block_k`-column tiles (K is contiguous in nn.Linear's [N, K] layout, so a tile row is
  16-byte vector loads). Full tiles load without masks: rows past N are clamped onto the
  last row and only the store is masked; the one partial K tile (K not a multiple of
  `block_k`) is masked.
- The product is a `tl.dot` of the weight tile [block_n, block_k] with the transposed x
  tile [block_k, 16]: the x rows (at most MAX_ROWS) are padded to the 16 columns an MMA
  needs, so tensor cores do the arithmetic and one compiled kernel serves every row
  count. The accumulator is float32.
- Split-K, only where the row tiles alone are too few to keep every SM reading: each
  split writes float32 partial sums [split, M, N] and a second small kernel adds them in
  a fixed order (run-to-run identical, no atomics), adds the bias and rounds once.

The split count depends on N, K and the GPU only, never on the rows, so a row's result is
the same at every M (batch invariance) and every buffer's size follows shapes alone: no
host sync, safe under CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    check_shape,
    interpret_mode,
    launch_config,
    lazy_jit,
    num_sms,
    tl,
)

# Most rows of x one call takes: the x tile is padded to the 16 columns of an MMA.
MAX_ROWS = 16
_BLOCK_M = 16


def _check_gemv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int, int]:
    check_shape("x", x, [None, None])
    M, K = x.shape
    check_shape("weight", weight, [None, K])
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(
            f"gemv takes at most {MAX_ROWS} rows of x, got {M}; use F.linear for more rows"
        )
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}"
            + ("" if bias is None else f", {bias.dtype}")
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gemv supports float32, float16 and bfloat16, got {x.dtype}")
    if bias is not None:
        check_shape("bias", bias, [N])
    return M, N, K


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] (nn.Linear's layout), bias [N] or None
    -> x weight^T + bias, [M, N] in x's dtype: exactly F.linear. `config` is the Triton
    launcher's and is ignored here."""
    _check_gemv_args(x, weight, bias)
    return F.linear(x, weight, bias)


def gemv_launch_config(
    N: int,
    K: int,
    M: int,
    dtype: torch.dtype,
    device: torch.device,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Launch parameters for weight [N, K] and M rows of x, `config` overriding the
    defaults (benchmarks/kernels/bench_gemv.py sweeps them). Not tuned on a GPU yet.

    block_n: weight rows per program (a power of two, at least 16: an MMA dimension).
        64 where that still gives four programs per SM, else 32.
    block_k: columns per K tile (a power of two, at least 16): 256 bytes of each row.
    split_k: programs along K. 1 where the row tiles give at least two programs per SM;
        else enough splits for that, each at least four K tiles long.
    num_warps, num_stages: Triton launch options (num_stages pipelines the K loop).

    M does not enter the defaults: a row's result must not depend on its batch.
    """
    if not 0 <= M <= MAX_ROWS:
        raise ValueError(f"gemv takes 0 to {MAX_ROWS} rows of x, got {M}")
    # The interpreter has no SMs; a small stand-in lets CPU tests reach the split path.
    sms = num_sms(device) if device.type == "cuda" else 2
    block_k = 256 // torch.empty((), dtype=dtype).element_size()
    block_n = 64 if -(-N // 64) >= 4 * sms else 32
    n_tiles, k_tiles = -(-N // block_n), -(-K // block_k)
    split_k = 1
    if n_tiles < 2 * sms:
        split_k = max(1, min(-(-2 * sms // n_tiles), k_tiles // 4))
    default = {
        "block_n": block_n,
        "block_k": block_k,
        "split_k": split_k,
        "num_warps": 4,
        "num_stages": 4,
    }
    cfg = launch_config("gemv", default, config)
    for key in ("block_n", "block_k"):
        if cfg[key] < 16:
            raise ValueError(f"gemv: launch parameter {key} must be at least 16, got {cfg[key]}")
    return cfg


# ---------------------------------------------------------------------------- Triton


@lazy_jit(
    do_not_specialize=[
        "M",
        "N",
        "K",
        "tiles_per_split",
        "stride_xm",
        "stride_om",
        "stride_os",
    ]
)
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    tiles_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N read the last row (in bounds, unmasked loads); their sums are not stored.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    m_ok = offs_m < M
    # NOTE: k_begin is a multiple of BLOCK_K by construction, so the compiler can prove
    # the 16-byte alignment of every tile row (the weight's row stride is specialised).
    k_begin = pid_k * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)
    num_full = tl.maximum(k_end - k_begin, 0) // BLOCK_K
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_begin + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(num_full):
        w = tl.load(w_ptrs).to(DOT_DTYPE)
        xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    k_tail = k_begin + num_full * BLOCK_K
    if k_tail < k_end:
        k_ok = (k_tail + offs_k) < k_end
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0).to(DOT_DTYPE)
        xt = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    out_mask = (offs_n < N)[:, None] & m_ok[None, :]
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@lazy_jit(do_not_specialize=["N", "num_splits", "stride_ps", "stride_pm", "stride_om"])
def _gemv_split_sum_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    N,
    num_splits,
    stride_ps,
    stride_pm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ptrs = partial_ptr + row * stride_pm + offs
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(num_splits):
        total += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += stride_ps
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


_SPLIT_SUM_BLOCK = 1024


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `gemv_ref` (same arguments, shapes and result). x may be a view
    with any row stride; weight must have unit column stride (nn.Linear's layout). No
    host sync, and buffers sized by shapes only: safe under CUDA graphs. `config`
    overrides launch parameters (see `gemv_launch_config`; benchmarks and tests only)."""
    M, N, K = _check_gemv_args(x, weight, bias)
    if weight.stride(1) != 1:
        raise ValueError(
            "gemv needs the weight's columns contiguous (stride 1, nn.Linear's [N, K] "
            f"layout), got strides {tuple(weight.stride())}"
        )
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    cfg = gemv_launch_config(N, K, M, x.dtype, x.device, config)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    k_tiles = -(-K // block_k)
    tiles_per_split = -(-k_tiles // cfg["split_k"])
    num_splits = -(-k_tiles // tiles_per_split)  # no split without a tile
    if x.dtype == torch.float32 or interpret_mode():
        # The interpreter mis-computes 16-bit tl.dot; float32 there is also more exact.
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
        precision = "tf32"  # unused for 16-bit operands
    split = num_splits > 1
    target = torch.empty((num_splits, M, N), dtype=torch.float32, device=x.device) if split else out
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    _gemv_kernel[(-(-N // block_n), num_splits)](
        x,
        weight,
        bias_arg,
        target,
        M,
        N,
        K,
        tiles_per_split,
        x.stride(0),
        weight.stride(0),
        target.stride(-2),
        target.stride(0) if split else 0,
        HAS_BIAS=bias is not None,
        SPLIT=split,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        _gemv_split_sum_kernel[(M, -(-N // _SPLIT_SUM_BLOCK))](
            target,
            bias_arg,
            out,
            N,
            num_splits,
            target.stride(0),
            target.stride(1),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK=_SPLIT_SUM_BLOCK,
        )
    return out
