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

`gemv_rope` is attention's qkv projection with RoPE and the KV-cache write in one launch,
the same way: a tile's rows are pairs, RoPE's (dims i and i + rotary_dim / 2 of a q or k
head) or two neighbouring dims kept as they are (past rotary_dim, and v), and each program
rotates its pairs and stores k and v at the token's cache slot as the RoPE kernel does.

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
from ssmserve.kernels.paged_attention import _check_kv_write_args
from ssmserve.kernels.rotary import rotary_embedding_ref


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
    N, _ = _check_gemv_args(x, weight, bias)
    _check_act_args(x.new_empty(0, N), act)
    return act_and_mul_ref(F.linear(x, weight, bias), act=act)


def gemv_rope_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scaling: float = 1.0,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention's qkv projection of one token and RoPE on it: x [1, K], weight
    [(H + 2 KVH) * D, K] (q's heads' rows, k's, v's), bias or None, positions [1],
    inv_freq [rotary_dim / 2] -> qkv [1, (H + 2 KVH) * D] with q and k rotated: F.linear,
    then `rotary_embedding` on its q and k (and its KV-cache write, given k_cache, v_cache
    and slot_mapping). `pdl` is the Triton launcher's."""
    _, head_dim, writes = _check_gemv_rope_args(
        x, weight, bias, positions, inv_freq, num_heads, num_kv_heads,
        (k_cache, v_cache, slot_mapping),
    )  # fmt: skip
    qkv = F.linear(x, weight, bias)
    q, k, v = qkv.view(num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads]
    )
    q, k = rotary_embedding_ref(
        positions, q[None], k[None], inv_freq, scaling=scaling,
        v=v[None] if writes else None, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping,
    )  # fmt: skip
    return torch.cat([q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1)], dim=1)


def _check_gemv_rope_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    caches: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> tuple[int, int, bool]:
    """Validate; return (N, head_dim, whether the call writes the KV cache)."""
    N, _ = _check_gemv_args(x, weight, bias)
    heads = num_heads + 2 * num_kv_heads
    if num_heads <= 0 or num_kv_heads <= 0 or N % heads or (N // heads) % 2:
        raise ValueError(
            f"gemv_rope: the weight's {N} rows must be (num_heads + 2 num_kv_heads) = "
            f"{heads} heads of an even head dim"
        )
    head_dim = N // heads
    check_shape("positions", positions, [1])
    if 2 * inv_freq.shape[0] > head_dim:
        raise ValueError(f"rotary_dim {2 * inv_freq.shape[0]} exceeds the head dim {head_dim}")
    given = [t is not None for t in caches]
    if any(given) and not all(given):
        raise ValueError(
            "gemv_rope writes the KV cache given k_cache, v_cache and slot_mapping "
            "together; pass all three or none"
        )
    if all(given):
        kv = x.new_empty(1, num_kv_heads, head_dim)
        _check_kv_write_args(kv, kv, *caches)
    return N, head_dim, all(given)


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


@device_function
def _row_sums(
    x_ptr,
    w_ptr,
    rows,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # x . W[rows] in float32, [BLOCK_N], `rows` in bounds; with PDL the first weight tile
    # loads before the wait (no kernel writes the weights) and x after it.
    offs_k = tl.arange(0, BLOCK_K)
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
    return tl.sum(acc, axis=1)


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
    if ACT < 0:
        offs_n = pid * BLOCK_N + offs
        # Rows past N read the last row (in bounds, unmasked); their sums are not stored.
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    else:
        rows = (tl.minimum(pid * (BLOCK_N // 2) + offs // 2, N - 1) + (offs % 2) * N).to(tl.int64)
    y = _row_sums(x_ptr, w_ptr, rows, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, PDL)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty)
    if ACT < 0:
        tl.store(out_ptr + offs_n, y, mask=offs_n < N)
    else:
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        offs_out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + offs_out, act_and_mul_tile(gate, up, ACT), mask=offs_out < N)


@lazy_jit(do_not_specialize=("pos_ptr", "slot_ptr"))
def _gemv_rope_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    pos_ptr,
    freq_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    N,
    K,
    stride_wn,
    num_q_heads,
    num_kv_heads,
    scaling,
    block_size,
    stride_kc_b,
    stride_kc_o,
    stride_kc_h,
    stride_vc_b,
    stride_vc_o,
    stride_vc_h,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    # The N = (q heads + 2 kv heads) * HEAD_DIM rows as N / 2 pairs, HEAD_DIM / 2 a head;
    # the tile's rows 2i and 2i + 1 are one pair's. Pair s of a q or k head with s < HALF
    # is RoPE's (dims s and s + HALF), rotated here; every other pair is two neighbouring
    # dims (2s, 2s + 1), kept (the dims past rotary_dim, and v). With WRITE_KV the k and v
    # pairs are also stored in the caches at the token's slot.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    qk_heads = num_q_heads + num_kv_heads
    pairs_a_head = HEAD_DIM // 2
    pair = tl.minimum(pid * (BLOCK_N // 2) + offs // 2, N // 2 - 1)
    head, s = pair // pairs_a_head, pair % pairs_a_head
    second = offs % 2
    dim = tl.where((head < qk_heads) & (s < HALF), s + second * HALF, 2 * s + second)
    rows = (head * HEAD_DIM + dim).to(tl.int64)
    # The pairs' own view, [BLOCK_N // 2]: head, pair in the head, the two dims.
    p = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    valid = p < N // 2
    p_head, p_s = p // pairs_a_head, p % pairs_a_head
    rotated = (p_head < qk_heads) & (p_s < HALF)
    dim0 = tl.where(rotated, p_s, 2 * p_s)
    dim1 = tl.where(rotated, p_s + HALF, 2 * p_s + 1)
    # Before the wait, as RoPE's kernel: the position, the frequencies and the slot (the
    # step's inputs, which no kernel of the step writes), and cos and sin from them.
    # The rotation too, RoPE's arithmetic and roundings (rotary.py's kernel).
    dtype = out_ptr.dtype.element_ty
    angle = tl.load(pos_ptr).to(tl.float32) * tl.load(freq_ptr + p_s, mask=rotated, other=0.0)
    cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
    if WRITE_KV:
        slot = tl.load(slot_ptr).to(tl.int64)
    y = _row_sums(x_ptr, w_ptr, rows, K, stride_wn, BLOCK_N, BLOCK_K, EVEN_K, PDL)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    a, b = tl.split(tl.reshape(y.to(dtype), [BLOCK_N // 2, 2]))
    af, bf = a.to(tl.float32), b.to(tl.float32)
    ra = ((af * cos).to(dtype).to(tl.float32) - (bf * sin).to(dtype).to(tl.float32)).to(dtype)
    rb = ((bf * cos).to(dtype).to(tl.float32) + (af * sin).to(dtype).to(tl.float32)).to(dtype)
    a = tl.where(rotated, ra, a)
    b = tl.where(rotated, rb, b)
    out_row = out_ptr + p_head * HEAD_DIM
    tl.store(out_row + dim0, a, mask=valid)
    tl.store(out_row + dim1, b, mask=valid)
    if WRITE_KV:
        write = valid & (slot >= 0)
        is_k = (p_head >= num_q_heads) & (p_head < qk_heads)
        is_v = p_head >= qk_heads
        kv_head = tl.where(is_k, p_head - num_q_heads, p_head - qk_heads)
        block, offset = slot // block_size, slot % block_size
        kc_row = kc_ptr + block * stride_kc_b + offset * stride_kc_o + kv_head * stride_kc_h
        vc_row = vc_ptr + block * stride_vc_b + offset * stride_vc_o + kv_head * stride_vc_h
        kc_dtype = kc_ptr.dtype.element_ty
        vc_dtype = vc_ptr.dtype.element_ty
        tl.store(kc_row + dim0, a.to(kc_dtype), mask=write & is_k)
        tl.store(kc_row + dim1, b.to(kc_dtype), mask=write & is_k)
        tl.store(vc_row + dim0, a.to(vc_dtype), mask=write & is_v)
        tl.store(vc_row + dim1, b.to(vc_dtype), mask=write & is_v)


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
    N, K = _check_gemv_args(x, weight, bias)
    _, inter = _check_act_args(x.new_empty(0, N), act)
    out = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    if inter == 0:
        return out
    if K == 0:
        gate_up = x.new_zeros(1, N) if bias is None else bias[None].clone()
        return out.copy_(act_and_mul_ref(gate_up, act=act))
    return _launch_gemv(x, weight, bias, out, act, pdl, config)


def gemv_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scaling: float = 1.0,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `gemv_rope_ref` (same arguments and shapes), one launch: bit for
    bit `rotary_embedding_triton` of `gemv_triton` at the same tile shape (`config` is
    the GEMV's; a tile of one row takes two, a pair)."""
    N, head_dim, writes = _check_gemv_rope_args(
        x, weight, bias, positions, inv_freq, num_heads, num_kv_heads,
        (k_cache, v_cache, slot_mapping),
    )  # fmt: skip
    K = x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1 or K == 0:
        raise ValueError("gemv_rope needs K > 0 and the weight's rows contiguous")
    if writes and (k_cache.stride(3) != 1 or v_cache.stride(3) != 1):
        raise ValueError("the KV caches' head dims must be contiguous")
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    cfg = gemv_launch_config(N, K, x.device, config)
    block_n = max(2, cfg["block_n"])
    caches = (
        (k_cache, v_cache, k_cache.shape[1], *k_cache.stride()[:3], *v_cache.stride()[:3])
        if writes
        else (None, None, 1, 0, 0, 0, 0, 0, 0)
    )
    _gemv_rope_kernel[(cdiv(N, block_n),)](
        x,
        weight,
        bias,
        out,
        positions,
        inv_freq,
        slot_mapping if writes else None,
        caches[0],
        caches[1],
        N,
        K,
        weight.stride(0),
        num_heads,
        num_kv_heads,
        float(scaling),
        *caches[2:],
        HEAD_DIM=head_dim,
        HALF=inv_freq.shape[0],
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=cfg["block_k"],
        EVEN_K=K % cfg["block_k"] == 0,
        WRITE_KV=writes,
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return out
