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

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import check_shape, check_varlen, process_dt


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
