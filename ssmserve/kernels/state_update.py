"""One decode token of a selective SSM (Mamba1 and Mamba2), state addressed by slot.

General layout: the state of one sequence is [H, P, N]. Per (h, p, n):

    dt    = clamp(softplus(dt[h, p] + dt_bias[h, p]), *dt_limit)
    S     = exp(dt * A[h, p, n]) * S + dt * x[h, p] * B[g, n]      g = h // (H // G)
    y     = sum_n S[h, p, n] * C[g, n] + D[h, p] * x[h, p];  y *= silu(z[h, p])

Mamba2 passes dt [Bt, H] expanded to [Bt, H, P] (stride 0), A [H] expanded to
[H, P, N], D and dt_bias [H] expanded to [H, P]. Mamba1 views its [slots, Dm, N]
pool as H = Dm, P = 1 with G = 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import check_shape, process_dt


def _check_state_update_args(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    state_slots: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    check_shape("x", x, [None, None, None])
    Bt, H, P = x.shape
    check_shape("B", B, [Bt, None, None])
    G, N = B.shape[1:]
    if G == 0 or H % G != 0:
        raise ValueError(f"number of heads ({H}) must be a multiple of n_groups ({G})")
    check_shape("ssm_state", ssm_state, [None, H, P, N])
    check_shape("dt", dt, [Bt, H, P])
    check_shape("A", A, [H, P, N])
    check_shape("C", C, [Bt, G, N])
    if D is not None:
        check_shape("D", D, [H, P])
    if z is not None:
        check_shape("z", z, [Bt, H, P])
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, [H, P])
    check_shape("state_slots", state_slots, [Bt])
    return Bt, H, P, G, N


def selective_state_update_ref(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """One-token SSM update in PyTorch (float32 math), in place on the state pool.

    Args:
        ssm_state: [num_slots, H, P, N] pool (float32 or 16-bit), updated in place.
        x, dt: [Bt, H, P]. A: [H, P, N] float32. B, C: [Bt, G, N].
        D: [H, P] or None. z: [Bt, H, P] or None. dt_bias: [H, P] or None.
        state_slots: [Bt] int; entries < 0 are padding: state untouched, output 0.

    Returns:
        y: [Bt, H, P] in x.dtype.
    """
    Bt, H, P, G, N = _check_state_update_args(ssm_state, x, dt, A, B, C, D, z, dt_bias, state_slots)
    heads_per_group = H // G
    rows = torch.nonzero(state_slots >= 0).squeeze(1)
    slots = state_slots[rows].long()
    dt_v = process_dt(dt[rows], dt_bias, dt_softplus, dt_limit)  # [Bv, H, P]
    x_v = x[rows].float()
    B_v = B[rows].float().repeat_interleave(heads_per_group, dim=1)  # [Bv, H, N]
    C_v = C[rows].float().repeat_interleave(heads_per_group, dim=1)
    state = ssm_state[slots].float()
    state = (
        state * torch.exp(dt_v[..., None] * A.float())
        + (dt_v * x_v)[..., None] * B_v[:, :, None, :]
    )
    ssm_state[slots] = state.to(ssm_state.dtype)
    y_v = torch.einsum("bhpn,bhn->bhp", state, C_v)
    if D is not None:
        y_v += D.float() * x_v
    if z is not None:
        y_v *= F.silu(z[rows].float())
    y = torch.zeros(Bt, H, P, dtype=x.dtype, device=x.device)
    y[rows] = y_v.to(x.dtype)
    return y
