"""Mamba1 prefill: variable-length selective scan.

Per channel d and state index n, for each token t of a sequence:

    delta_t = softplus(delta_t + delta_bias)          (softplus if delta_softplus)
    h_t     = exp(delta_t * A[d, n]) * h_{t-1} + delta_t * u_t * B_t[n]
    y_t     = sum_n h_t[n] * C_t[n] + D[d] * u_t;   y_t *= silu(z_t) if z is given

h_{-1} is the slot state if has_initial_state else zeros; the final h goes back to
the slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import check_shape, check_varlen, lazy_jit, next_pow2, tl, triton

# Tokens whose decay and input terms the twin materialises at once ([L, Dm, N] floats).
_REF_BLOCK = 256


def _check_selective_scan_args(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
) -> tuple[int, int, int]:
    check_shape("u", u, [None, None])
    T, Dm = u.shape
    check_shape("A", A, [Dm, None])
    N = A.shape[1]
    check_shape("delta", delta, [T, Dm])
    check_shape("B", B, [T, N])
    check_shape("C", C, [T, N])
    if D is not None:
        check_shape("D", D, [Dm])
    if z is not None:
        check_shape("z", z, [T, Dm])
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, [Dm])
    check_shape("ssm_state", ssm_state, [None, Dm, N])
    check_shape("state_slots", state_slots, [None])
    return T, Dm, N


def selective_scan_varlen_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
) -> torch.Tensor:
    """Varlen selective scan (Mamba1 prefill) in PyTorch, float32 state math.

    Args:
        u, delta: [T, Dm] packed inputs and raw time steps.
        A: [Dm, N] float32 (already -exp(A_log)).
        B, C: [T, N].
        D: [Dm] or None.
        cu_seqlens: [S+1] int32 sequence boundaries.
        ssm_state: [num_slots, Dm, N] pool, updated in place at state_slots.
        state_slots: [S] int. has_initial_state: [S] bool.
        z: [T, Dm] gate or None. delta_bias: [Dm] or None.

    Returns:
        y: [T, Dm] in u.dtype.
    """
    T, Dm, N = _check_selective_scan_args(
        u, delta, A, B, C, D, ssm_state, state_slots, z, delta_bias
    )
    seqs = check_varlen(cu_seqlens, state_slots, has_initial_state, T, ssm_state.shape[0])
    delta_f = delta.float()
    if delta_bias is not None:
        delta_f = delta_f + delta_bias.float()
    if delta_softplus:
        delta_f = F.softplus(delta_f)
    A_f = A.float()
    y = torch.empty(T, Dm, dtype=torch.float32, device=u.device)
    for start, end, slot, has_init in seqs:
        state = ssm_state[slot].float() if has_init else u.new_zeros(Dm, N, dtype=torch.float32)
        for c0 in range(start, end, _REF_BLOCK):
            c1 = min(c0 + _REF_BLOCK, end)
            decay = torch.exp(delta_f[c0:c1, :, None] * A_f)  # [L, Dm, N]
            states = (delta_f[c0:c1] * u[c0:c1].float())[:, :, None] * B[c0:c1, None, :].float()
            # A per-token loop of one fused multiply-add on a [Dm, N] state that stays in
            # cache: with N = 16 this beats any pairwise (chunked-matmul) form on CPU.
            for t in range(c1 - c0):
                torch.addcmul(states[t], decay[t], state, out=states[t])
                state = states[t]
            y[c0:c1] = torch.einsum("tdn,tn->td", states, C[c0:c1].float())
            state = state.clone()
        ssm_state[slot] = state.to(ssm_state.dtype)
    if D is not None:
        y += D.float() * u.float()
    if z is not None:
        y *= F.silu(z.float())
    return y.to(u.dtype)


# ---------------------------------------------------------------------------- Triton


@lazy_jit
def _selective_scan_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, y_ptr, state_ptr,
    cu_seqlens_ptr, state_slots_ptr, has_init_ptr, Dm, N,
    stride_u_t, stride_u_d, stride_delta_t, stride_delta_d, stride_a_d, stride_a_n,
    stride_b_t, stride_b_n, stride_c_t, stride_c_n, stride_z_t, stride_z_d,
    stride_y_t, stride_y_d, stride_s_slot, stride_s_d, stride_s_n,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr,
    DELTA_SOFTPLUS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, channel block) steps through the tokens with the
    # [BLOCK_D, N] state in registers. Mamba1 has small N (16), so a step is cheap and
    # the sequential walk is bounded by load latency, hidden across many programs.
    seq = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < Dm
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    state_ptrs = (state_ptr + slot * stride_s_slot + offs_d[:, None] * stride_s_d
                  + offs_n[None, :] * stride_s_n)  # fmt: skip
    state = tl.load(state_ptrs, mask=mask_dn & has_init, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + offs_d[:, None] * stride_a_d + offs_n[None, :] * stride_a_n,
                mask=mask_dn, other=0.0).to(tl.float32)  # fmt: skip
    if HAS_DELTA_BIAS:
        delta_bias = tl.load(delta_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    for t in range(start, end):
        u = tl.load(u_ptr + t * stride_u_t + offs_d * stride_u_d, mask=mask_d, other=0.0)
        u = u.to(tl.float32)
        delta = tl.load(delta_ptr + t * stride_delta_t + offs_d * stride_delta_d,
                        mask=mask_d, other=0.0).to(tl.float32)  # fmt: skip
        if HAS_DELTA_BIAS:
            delta += delta_bias
        if DELTA_SOFTPLUS:
            delta = tl.where(delta <= 20.0, tl.log(1.0 + tl.exp(delta)), delta)
        b = tl.load(B_ptr + t * stride_b_t + offs_n * stride_b_n, mask=mask_n, other=0.0)
        c = tl.load(C_ptr + t * stride_c_t + offs_n * stride_c_n, mask=mask_n, other=0.0)
        state = (
            state * tl.exp(delta[:, None] * A) + (delta * u)[:, None] * b.to(tl.float32)[None, :]
        )
        y = tl.sum(state * c.to(tl.float32)[None, :], axis=1)
        if HAS_D:
            y += D * u
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_z_t + offs_d * stride_z_d, mask=mask_d, other=0.0)
            z = z.to(tl.float32)
            y *= z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + t * stride_y_t + offs_d * stride_y_d, y.to(y_ptr.dtype.element_ty),
                 mask=mask_d)  # fmt: skip
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask_dn)


def selective_scan_varlen_triton(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = True,
) -> torch.Tensor:
    """Triton twin of `selective_scan_varlen_ref` (same arguments, shapes and result).

    No host sync; cu_seqlens and slot values are not validated (slots must be valid
    and distinct).
    """
    T, Dm, N = _check_selective_scan_args(
        u, delta, A, B, C, D, ssm_state, state_slots, z, delta_bias
    )
    S = state_slots.shape[0]
    check_shape("cu_seqlens", cu_seqlens, [S + 1])
    check_shape("has_initial_state", has_initial_state, [S])
    y = torch.empty_like(u)
    if S == 0:
        return y
    block_n = next_pow2(N)
    block_d = max(1, min(next_pow2(Dm), 2048 // block_n))
    grid = (S, triton.cdiv(Dm, block_d))
    _selective_scan_kernel[grid](
        u, delta, A, B, C, D, z, delta_bias, y, ssm_state,
        cu_seqlens, state_slots, has_initial_state.to(torch.int8), Dm, N,
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
        *(z.stride() if z is not None else (0, 0)), *y.stride(), *ssm_state.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=delta_softplus, BLOCK_D=block_d, BLOCK_N=block_n,
    )  # fmt: skip
    return y
