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

from ssmserve.kernels._common import check_shape, check_varlen

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
