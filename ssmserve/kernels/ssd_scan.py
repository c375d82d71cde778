"""Mamba2 prefill: variable-length SSD (state space duality) chunked scan.

Per head h (group g = h // (H // G)), for each token t of a sequence:

    dt_t  = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      S: [P, N]
    y_t   = S_t @ C_t + D * x_t;   y_t *= silu(z_t) if z is given

S_{-1} is the sequence's slot state if has_initial_state else zeros; the final S is
written back to the slot. The chunked form (used by both twin and kernel) computes,
per chunk of L tokens with cum_i = sum_{k<=i} dt_k A:

    y_i = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) (S_in @ C_i)
    S_out = exp(cum_L) S_in + sum_j exp(cum_L - cum_j) dt_j outer(x_j, B_j)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    check_shape,
    check_varlen,
    interpret_mode,
    lazy_jit,
    next_pow2,
    prev_pow2,
    process_dt,
    tl,
    triton,
)


def _check_ssd_args(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_bias: torch.Tensor | None,
    z: torch.Tensor | None,
    chunk_size: int,
) -> tuple[int, int, int, int, int]:
    check_shape("x", x, [None, None, None])
    T, H, P = x.shape
    check_shape("B", B, [T, None, None])
    G, N = B.shape[1:]
    if G == 0 or H % G != 0:
        raise ValueError(f"number of heads ({H}) must be a multiple of n_groups ({G})")
    check_shape("dt", dt, [T, H])
    check_shape("A", A, [H])
    check_shape("C", C, [T, G, N])
    if D is not None:
        check_shape("D", D, [H])
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, [H])
    if z is not None:
        check_shape("z", z, [T, H, P])
    check_shape("ssm_state", ssm_state, [None, H, P, N])
    check_shape("state_slots", state_slots, [None])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return T, H, P, G, N


def ssd_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    z: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Varlen SSD scan (Mamba2 prefill) in PyTorch, float32 state math.

    Args:
        x: [T, H, P] inputs of all sequences, packed.
        dt: [T, H] raw time steps (bias, softplus and clamp applied here).
        A: [H] float32, already -exp(A_log).
        B, C: [T, G, N]; head h reads group h // (H // G).
        D: [H] skip connection, or None.
        cu_seqlens: [S+1] int32; sequence s is tokens cu_seqlens[s]:cu_seqlens[s+1].
        ssm_state: [num_slots, H, P, N] state pool (float32 or bf16), updated in place:
            ssm_state[state_slots[s]] receives sequence s's final state.
        state_slots: [S] int, slot of each sequence.
        has_initial_state: [S] bool; start from ssm_state[slot] if True, else zeros.
        dt_bias: [H] or None. dt_softplus, dt_limit: see module docstring.
        z: [T, H, P] gate or None (y *= silu(z)).
        chunk_size: blocking only; results do not depend on it beyond rounding.

    Returns:
        y: [T, H, P] in x.dtype.
    """
    T, H, P, G, N = _check_ssd_args(
        x,
        dt,
        A,
        B,
        C,
        D,
        cu_seqlens,
        ssm_state,
        state_slots,
        has_initial_state,
        dt_bias,
        z,
        chunk_size,
    )
    seqs = check_varlen(cu_seqlens, state_slots, has_initial_state, T, ssm_state.shape[0])
    heads_per_group = H // G
    dt_all = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    A_gh = A.float().view(G, heads_per_group)
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    for start, end, slot, has_init in seqs:
        if has_init:
            state = ssm_state[slot].float().view(G, heads_per_group, P, N)
        else:
            state = x.new_zeros(G, heads_per_group, P, N, dtype=torch.float32)
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            length = c1 - c0
            x_c = x[c0:c1].float().view(length, G, heads_per_group, P)
            dt_c = dt_all[c0:c1].view(length, G, heads_per_group)
            B_c = B[c0:c1].float()
            C_c = C[c0:c1].float()
            cum = torch.cumsum(dt_c * A_gh, dim=0)  # [L, G, Hg]
            cum_ghl = cum.permute(1, 2, 0)  # [G, Hg, L]
            # Mask before exp: above the diagonal cum_i - cum_j is positive and may overflow.
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            seg = (cum_ghl[..., :, None] - cum_ghl[..., None, :]).masked_fill(~causal, -math.inf)
            decay = torch.exp(seg)  # [G, Hg, L(i), L(j)]
            cb = torch.einsum("ign,jgn->gij", C_c, B_c)
            weights = cb[:, None] * decay * dt_c.permute(1, 2, 0)[:, :, None, :]
            y_c = torch.einsum("ghij,jghp->ighp", weights, x_c)
            y_c += torch.einsum("ign,ghpn->ighp", C_c, state) * torch.exp(cum)[..., None]
            decay_to_end = torch.exp(cum[-1] - cum) * dt_c  # [L, G, Hg]
            state = state * torch.exp(cum[-1])[..., None, None] + torch.einsum(
                "jghp,jgn->ghpn", decay_to_end[..., None] * x_c, B_c
            )
            y[c0:c1] = y_c.reshape(length, H, P)
        ssm_state[slot] = state.reshape(H, P, N).to(ssm_state.dtype)
    if D is not None:
        y += D.float()[:, None] * x.float()
    if z is not None:
        y *= F.silu(z.float())
    return y.to(x.dtype)


# ---------------------------------------------------------------------------- Triton


@lazy_jit
def _ssd_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, state_ptr,
    cu_seqlens_ptr, state_slots_ptr, has_init_ptr,
    heads_per_group, P, N, dt_min, dt_max,
    stride_x_t, stride_x_h, stride_x_p,
    stride_dt_t, stride_dt_h,
    stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n,
    stride_z_t, stride_z_h, stride_z_p,
    stride_y_t, stride_y_h, stride_y_p,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, CLAMP_DT: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, STATE_PRECISION: tl.constexpr,
):  # fmt: skip
    # One program walks one (sequence, head, P-block) through all of the sequence's
    # chunks, carrying the [BLOCK_P, N] state in registers: no inter-chunk state
    # tensor round-trips through memory, and a resumed sequence needs nothing special.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    pid_p = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    group = head // heads_per_group

    offs_l = tl.arange(0, CHUNK)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    state_ptrs = (
        state_ptr + slot * stride_s_slot + head * stride_s_h
        + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n
    )  # fmt: skip
    state = tl.load(state_ptrs, mask=mask_pn & has_init, other=0.0).to(tl.float32)

    A = tl.load(A_ptr + head).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + head).to(tl.float32)
    causal = offs_l[:, None] >= offs_l[None, :]

    for c0 in range(start, end, CHUNK):
        t = c0 + offs_l
        mask_t = t < end
        mask_tp = mask_t[:, None] & mask_p[None, :]
        mask_tn = mask_t[:, None] & mask_n[None, :]
        dt = tl.load(dt_ptr + t * stride_dt_t + head * stride_dt_h, mask=mask_t, other=0.0)
        dt = dt.to(tl.float32)
        if HAS_DT_BIAS:
            dt += dt_bias
        if DT_SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        if CLAMP_DT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        # Tokens past the end: no decay and no input, so they leave the state alone.
        dt = tl.where(mask_t, dt, 0.0)
        dA = dt * A
        cum = tl.cumsum(dA, 0)
        total = tl.sum(dA, 0)

        x = tl.load(
            x_ptr + t[:, None] * stride_x_t + head * stride_x_h + offs_p[None, :] * stride_x_p,
            mask=mask_tp, other=0.0,
        )  # fmt: skip
        b = tl.load(
            B_ptr + t[:, None] * stride_b_t + group * stride_b_g + offs_n[None, :] * stride_b_n,
            mask=mask_tn, other=0.0,
        )  # fmt: skip
        c = tl.load(
            C_ptr + t[:, None] * stride_c_t + group * stride_c_g + offs_n[None, :] * stride_c_n,
            mask=mask_tn, other=0.0,
        )  # fmt: skip

        # Intra-chunk: y_i += sum_{j<=i} (C_i.B_j) exp(cum_i - cum_j) dt_j x_j.
        cb = tl.dot(c.to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        # -inf above the diagonal before exp: cum_i - cum_j > 0 there and may overflow.
        seg = tl.where(causal, cum[:, None] - cum[None, :], -float("inf"))
        weights = cb * tl.exp(seg) * dt[None, :]
        y = tl.dot(weights.to(DOT_DTYPE), x.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        # Incoming state: y_i += exp(cum_i) C_i . S. The state stays float32 (tf32 on GPU
        # for 16-bit inputs) so long sequences do not accumulate 16-bit rounding.
        y_state = tl.dot(
            c.to(tl.float32), tl.trans(state), input_precision=STATE_PRECISION
        )  # fmt: skip
        y += y_state * tl.exp(cum)[:, None]
        x_f = x.to(tl.float32)
        if HAS_D:
            y += D * x_f
        if HAS_Z:
            z = tl.load(
                z_ptr + t[:, None] * stride_z_t + head * stride_z_h + offs_p[None, :] * stride_z_p,
                mask=mask_tp, other=0.0,
            ).to(tl.float32)  # fmt: skip
            y *= z / (1.0 + tl.exp(-z))
        tl.store(
            y_ptr + t[:, None] * stride_y_t + head * stride_y_h + offs_p[None, :] * stride_y_p,
            y.to(y_ptr.dtype.element_ty), mask=mask_tp,
        )  # fmt: skip

        # State: S = exp(total) S + sum_j exp(total - cum_j) dt_j outer(x_j, B_j).
        x_scaled = x_f * (tl.exp(total - cum) * dt)[:, None]
        state = state * tl.exp(total) + tl.dot(
            tl.trans(x_scaled), b.to(tl.float32), input_precision=STATE_PRECISION
        )  # fmt: skip

    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_pn)


def _launch_config(
    x: torch.Tensor, S: int, H: int, P: int, N: int, chunk_size: int
) -> dict[str, Any]:
    """Block sizes and launch options (benchmarks/kernels/bench_kernels.py sweeps these)."""
    # Measured on an H200 at 32k tokens (docs/kernels_notes.md): 32-token chunks, 32-wide
    # P blocks and 4 warps were fastest (2.6 ms vs 6.2 ms for 64-token chunks).
    chunk = max(16, min(32, prev_pow2(chunk_size)))
    block_p = min(32, max(16, next_pow2(P)))
    return {"chunk": chunk, "block_p": block_p, "num_warps": 4, "num_stages": 2}


def _dot_config(dtype: torch.dtype) -> tuple[Any, str, str]:
    """(dtype of intra-chunk dot operands, its precision, precision of state dots)."""
    if dtype == torch.float32 or interpret_mode():
        # The interpreter mis-computes 16-bit tl.dot; float32 there is also more exact.
        return tl.float32, "ieee", "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32", "tf32"


def ssd_scan_varlen_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    z: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """Triton twin of `ssd_scan_varlen_ref` (same arguments, shapes and result).

    The kernel blocks by min(chunk_size, 32) tokens rounded down to a power of two
    (at least 16, for tensor-core dots); blocking only affects rounding. cu_seqlens,
    state_slots and has_initial_state values are not validated (no host sync): slots
    must be valid and distinct.
    """
    T, H, P, G, N = _check_ssd_args(
        x, dt, A, B, C, D, cu_seqlens, ssm_state, state_slots, has_initial_state, dt_bias, z,
        chunk_size,
    )  # fmt: skip
    S = state_slots.shape[0]
    check_shape("cu_seqlens", cu_seqlens, [S + 1])
    check_shape("has_initial_state", has_initial_state, [S])
    y = torch.empty_like(x)
    if S == 0:
        return y
    cfg = _launch_config(x, S, H, P, N, chunk_size)
    dot_dtype, dot_precision, state_precision = _dot_config(x.dtype)
    if cfg.get("state_precision") and not interpret_mode() and x.dtype != torch.float32:
        state_precision = cfg["state_precision"]
    lo, hi = dt_limit
    z_strides = z.stride() if z is not None else (0, 0, 0)
    grid = (S, H, triton.cdiv(P, cfg["block_p"]))
    _ssd_scan_kernel[grid](
        x, dt, A, B, C, D, z, dt_bias, y, ssm_state,
        cu_seqlens, state_slots, has_initial_state.to(torch.int8),
        H // G, P, N, float(lo), float(hi),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *z_strides, *y.stride(),
        *ssm_state.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, CLAMP_DT=lo > 0.0 or hi < math.inf,
        CHUNK=cfg["chunk"], BLOCK_P=cfg["block_p"], BLOCK_N=next_pow2(N),
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, STATE_PRECISION=state_precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return y
