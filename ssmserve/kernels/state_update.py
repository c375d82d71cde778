"""One decode token of a selective SSM (Mamba1 and Mamba2), state addressed by slot.

General layout: the state of one sequence is [H, P, N]. Per (h, p, n):

    dt    = clamp(softplus(dt[h, p] + dt_bias[h, p]), *dt_limit)
    S     = exp(dt * A[h, p, n]) * S + dt * x[h, p] * B[g, n]      g = h // (H // G)
    y     = sum_n S[h, p, n] * C[g, n] + D[h, p] * x[h, p];  y *= silu(z[h, p])

Mamba2 passes dt [Bt, H] expanded to [Bt, H, P] (stride 0), A [H] expanded to
[H, P, N], D and dt_bias [H] expanded to [H, P]. Mamba1 views its [slots, Dm, N]
pool as H = Dm, P = 1 with G = 1, and may pass its low-rank dt [Bt, R] with dt_proj's
weight [Dm, R] (`dt_proj_weight`): dt[h, p] is then that projection, in dt's dtype.

The new state is computed in float32; y reads it before it is stored. A 16-bit pool
takes it rounded to nearest, or stochastically (`rounding_offsets`; see
stochastic_rounding.py) with the noise of element (h, p, n) of row b drawn from
(rounding_seed, rounding_offsets[b], (h * P + p) * N + n).
"""

from __future__ import annotations

import math
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
    pdl_launch,
    process_dt,
    tl,
)
from ssmserve.kernels.stochastic_rounding import (
    ROUNDED_DTYPES,
    launch_seed,
    rounding_bits_ref,
    stochastic_round_ref,
    store_state,
)


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
    rounding_offsets: torch.Tensor | None,
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
    if rounding_offsets is not None:
        check_shape("rounding_offsets", rounding_offsets, [Bt])
    return Bt, H, P, G, N


def _project_dt(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_proj_weight: torch.Tensor | None,
    project: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """Check a low-rank dt [Bt, R] against dt_proj_weight [H * P, R]; with `project`,
    return project(dt, weight) as [Bt, H, P]. Without a weight, dt as it is."""
    if dt_proj_weight is None:
        return dt
    check_shape("x", x, [None, None, None])
    Bt, H, P = x.shape
    check_shape("dt", dt, [Bt, None])
    check_shape("dt_proj_weight", dt_proj_weight, [H * P, dt.shape[1]])
    return project(dt, dt_proj_weight).view(Bt, H, P) if project is not None else dt


def _stochastic_rounding(ssm_state: torch.Tensor, rounding_offsets: torch.Tensor | None) -> bool:
    """Whether writes into this pool round stochastically (a float32 pool stores exactly)."""
    return rounding_offsets is not None and ssm_state.dtype in ROUNDED_DTYPES


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
    rounding_offsets: torch.Tensor | None = None,
    rounding_seed: int = 0,
    dt_proj_weight: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One-token SSM update in PyTorch (float32 math), in place on the state pool.

    Args:
        ssm_state: [num_slots, H, P, N] pool (float32 or 16-bit), updated in place.
        x, dt: [Bt, H, P]. A: [H, P, N] float32. B, C: [Bt, G, N].
        D: [H, P] or None. z: [Bt, H, P] or None. dt_bias: [H, P] or None.
        state_slots: [Bt] int; entries < 0 are padding: state untouched, output 0.
        rounding_offsets: [Bt] int (the tokens' positions) or None. Given, a 16-bit pool
            takes the new state stochastically rounded, with noise from (rounding_seed,
            offset, element); None (or a float32 pool): rounded to nearest.
        rounding_seed: the noise's 32-bit key (one per layer).
        dt_proj_weight: [H * P, R] or None. Given, dt is Mamba1's low-rank dt [Bt, R] and
            the update takes dt_proj(dt) (F.linear, in dt's dtype) for it: the
            projection inside the update, one launch fewer a layer.

    Returns:
        y: [Bt, H, P] in x.dtype.
    """
    dt = _project_dt(x, dt, dt_proj_weight, F.linear)
    Bt, H, P, G, N = _check_state_update_args(
        ssm_state, x, dt, A, B, C, D, z, dt_bias, state_slots, rounding_offsets
    )
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
    if _stochastic_rounding(ssm_state, rounding_offsets):
        bits = rounding_bits_ref(rounding_seed, rounding_offsets[rows], H * P * N)
        stored = stochastic_round_ref(state, ssm_state.dtype, bits.view(-1, H, P, N))
    else:
        stored = state.to(ssm_state.dtype)
    ssm_state[slots] = stored
    y_v = torch.einsum("bhpn,bhn->bhp", state, C_v)
    if D is not None:
        y_v += D.float() * x_v
    if z is not None:
        y_v *= F.silu(z[rows].float())
    y = torch.zeros(Bt, H, P, dtype=x.dtype, device=x.device)
    y[rows] = y_v.to(x.dtype)
    return y


# ---------------------------------------------------------------------------- Triton


# Not specialised: the slots (a view into the step's packed indices) and the batch
# strides, which a one-row batch changes (torch gives a one-row view contiguous strides:
# x.view(1, H, P) of a [1, conv_dim] slice has stride H * P, not conv_dim). A row's
# vectors (x, B, C, y) come to at most one element per thread at the default launch, so
# no vector width is lost.
@lazy_jit(
    do_not_specialize=(
        "state_slots_ptr",
        # The positions (a view into the step's packed inputs) and a key per layer.
        "rounding_offsets_ptr",
        "rounding_seed",
        "stride_x_b",
        "stride_dt_b",
        "stride_b_b",
        "stride_c_b",
        "stride_z_b",
        "stride_y_b",
    )
)
def _state_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    dt_bias_ptr,
    y_ptr,
    state_slots_ptr,
    rounding_offsets_ptr,
    rounding_seed,
    heads_per_group,
    P,
    N,
    dt_min,
    dt_max,
    stride_s_slot,
    stride_s_h,
    stride_s_p,
    stride_s_n,
    stride_x_b,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_h,
    stride_dt_p,
    stride_a_h,
    stride_a_p,
    stride_a_n,
    stride_b_b,
    stride_b_g,
    stride_b_n,
    stride_c_b,
    stride_c_g,
    stride_c_n,
    stride_d_h,
    stride_d_p,
    stride_z_b,
    stride_z_h,
    stride_z_p,
    stride_bias_h,
    stride_bias_p,
    stride_y_b,
    stride_y_h,
    stride_y_p,
    dtw_ptr,
    R,
    stride_dtw_c,
    stride_dtw_r,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    CLAMP_DT: tl.constexpr,
    TIED: tl.constexpr,
    ROUNDING: tl.constexpr,  # 0: to nearest; stochastic, 1: to bfloat16, 2: to float16
    DT_PROJ: tl.constexpr,  # dt is the low-rank [Bt, R] (stride_dt_h over R), projected here
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    valid = slot >= 0
    group = head // heads_per_group

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :] & valid
    state_ptrs = (
        state_ptr
        + slot * stride_s_slot
        + head * stride_s_h
        + offs_p[:, None] * stride_s_p
        + offs_n[None, :] * stride_s_n
    )
    if PDL:
        gdc_launch_dependents()
    # With PDL the slots (the step's input) and this row's state are read before the wait:
    # only this kernel writes the state, and the step before has finished (every step has
    # launches without PDL, which wait for everything before them).
    state = tl.load(state_ptrs, mask=mask_pn, other=0.0).to(tl.float32)
    if DT_PROJ:
        # This program's rows of dt_proj's weight (channel head * P + p), which no
        # kernel writes: read before the wait too.
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        dt_w = tl.load(
            dtw_ptr + (head * P + offs_p)[:, None] * stride_dtw_c + offs_r[None, :] * stride_dtw_r,
            mask=mask_p[:, None] & mask_r[None, :],
            other=0.0,
        )
    # D, and after the wait z, B and C, are read here rather than where they are used:
    # the compiler keeps a load below the state store (for all it knows they alias) and
    # below the barriers of dt_proj's sums, each one more round trip on the critical path
    # of a batch-1 layer.
    if HAS_D:
        if TIED:
            d = tl.load(D_ptr + head * stride_d_h).to(tl.float32)
        else:
            d_ptrs = D_ptr + head * stride_d_h + offs_p * stride_d_p
            d = tl.load(d_ptrs, mask=mask_p, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(
        x_ptr + row * stride_x_b + head * stride_x_h + offs_p * stride_x_p, mask=mask_p, other=0.0
    ).to(tl.float32)
    if HAS_Z:
        z_ptrs = z_ptr + row * stride_z_b + head * stride_z_h + offs_p * stride_z_p
        z = tl.load(z_ptrs, mask=mask_p, other=0.0).to(tl.float32)
    b = tl.load(
        B_ptr + row * stride_b_b + group * stride_b_g + offs_n * stride_b_n, mask=mask_n, other=0.0
    ).to(tl.float32)
    c = tl.load(
        C_ptr + row * stride_c_b + group * stride_c_g + offs_n * stride_c_n, mask=mask_n, other=0.0
    ).to(tl.float32)

    if TIED:
        # Mamba2: dt, A, D and dt_bias are per head (stride 0 over P and N): load and
        # transform them once per program instead of once per element.
        dt = tl.load(dt_ptr + row * stride_dt_b + head * stride_dt_h).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + head * stride_bias_h).to(tl.float32)
    else:
        if DT_PROJ:
            dt_in = tl.load(
                dt_ptr + row * stride_dt_b + offs_r * stride_dt_h, mask=mask_r, other=0.0
            )
            dt = tl.sum(dt_w.to(tl.float32) * dt_in.to(tl.float32)[None, :], axis=1)
            # Rounded as the linear's output is, to the input's dtype.
            dt = dt.to(dt_ptr.dtype.element_ty).to(tl.float32)
        else:
            dt = tl.load(
                dt_ptr + row * stride_dt_b + head * stride_dt_h + offs_p * stride_dt_p,
                mask=mask_p,
                other=0.0,
            ).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(
                dt_bias_ptr + head * stride_bias_h + offs_p * stride_bias_p, mask=mask_p, other=0.0
            ).to(tl.float32)
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if CLAMP_DT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)

    if TIED:
        A = tl.load(A_ptr + head * stride_a_h).to(tl.float32)
        decay = tl.exp(dt * A)
        dtx = dt * x
    else:
        A = tl.load(
            A_ptr + head * stride_a_h + offs_p[:, None] * stride_a_p + offs_n[None, :] * stride_a_n,
            mask=mask_p[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)
        decay = tl.exp(dt[:, None] * A)
        dtx = dt * x

    state = state * decay + dtx[:, None] * b[None, :]
    store_state(
        state_ptr, state_ptrs, state, mask_pn, rounding_offsets_ptr, row, rounding_seed,
        head, P, N, offs_p, offs_n, ROUNDING,
    )  # fmt: skip

    y = tl.sum(state * c[None, :], axis=1)
    if HAS_D:
        y += d * x
    if HAS_Z:
        y *= z / (1.0 + tl.exp(-z))
    y = tl.where(valid, y, 0.0)
    tl.store(
        y_ptr + row * stride_y_b + head * stride_y_h + offs_p * stride_y_p,
        y.to(y_ptr.dtype.element_ty),
        mask=mask_p,
    )


def update_launch_config(P: int, N: int, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Launch parameters for head dim P and state dim N, `config` overriding the defaults
    (benchmarks/kernels/bench_state_update.py sweeps them).

    block_p: head-dim rows per program. The default gives ~2k state elements per program:
        enough bytes in flight per SM at large batch, and enough programs at batch 1 to
        cover the SMs. On the H200 every block size measured lies within 2% of the
        others at batch 64 and 256 (benchmarks/results/kernels_2026-11-29_h200_full.md).
    num_warps: warps per program.
    """
    default = {"block_p": min(next_pow2(P), max(1, 2048 // next_pow2(N))), "num_warps": 4}
    return launch_config("selective_state_update", default, config)


def _tied_over_p(t: torch.Tensor | None, dims: tuple[int, ...]) -> bool:
    return t is None or all(t.stride(d) == 0 for d in dims)


# Programs a regrouped Mamba1 update aims for at least (a few per SM of an H200).
_MIN_PROGRAMS = 1024


def _channels_per_head(Bt: int, H: int, G: int, N: int, device: torch.device | None = None) -> int:
    """For Mamba1's layout (P = 1: each channel its own "head"), how many channels one
    program takes: a power of two dividing H // G, up to ~2k state elements a program,
    fewer while that leaves under _MIN_PROGRAMS programs. One program per channel (16
    elements at d_state 16) ran 40x off the copy rate at batch 256. The interpreter has
    no SMs to fill and pays per program, so off a GPU the floor is 1/64 of it."""
    minimum = _MIN_PROGRAMS
    if device is not None and device.type != "cuda":
        minimum = _MIN_PROGRAMS // 64
    per = 1
    while per * 2 * next_pow2(N) <= 2048 and (H // G) % (per * 2) == 0:
        per *= 2
    while per > 1 and (H // per) * Bt < minimum:
        per //= 2
    return per


def _regroup(t: torch.Tensor | None, dim: int, per: int) -> torch.Tensor | None:
    """View t's size-H dimension `dim` followed by its size-1 dimension as [H // per, per]
    (channel h becomes head h // per, row h % per), whatever its strides."""
    if t is None or per == 1:
        return t
    size, stride = list(t.shape), list(t.stride())
    size[dim : dim + 2] = [size[dim] // per, per]
    stride[dim : dim + 2] = [stride[dim] * per, stride[dim]]
    return t.as_strided(size, stride, t.storage_offset())


def selective_state_update_triton(
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
    rounding_offsets: torch.Tensor | None = None,
    rounding_seed: int = 0,
    dt_proj_weight: torch.Tensor | None = None,
    config: Mapping[str, Any] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Triton twin of `selective_state_update_ref` (same arguments, shapes and result).

    When dt, A, D and dt_bias are all stride-0 over P (and A over N), as in Mamba2,
    the kernel reads them once per head. No host sync: safe under CUDA graphs, and with
    stochastic rounding a replayed graph draws fresh noise each step, because the noise
    comes from the `rounding_offsets` tensor (positions) it reads, not from a host value.
    `config` overrides launch parameters (see `update_launch_config`; benchmarks and
    tests only).
    """
    low_rank = _project_dt(x, dt, dt_proj_weight, None)
    if dt_proj_weight is not None:  # what follows sees a stand-in of the projected dt's shape
        dt = dt.new_empty(1).view(1, 1, 1).expand(x.shape)
    Bt, H, P, G, N = _check_state_update_args(
        ssm_state, x, dt, A, B, C, D, z, dt_bias, state_slots, rounding_offsets
    )
    y = torch.empty(Bt, H, P, dtype=x.dtype, device=x.device)
    if Bt == 0:
        return y
    y_out = y
    if P == 1:
        # Mamba1: regroup channels into heads of `per` rows, so a program covers many
        # channels. Element (h, 0, n) keeps its flat index h * N + n (its rounding noise).
        per = _channels_per_head(Bt, H, G, N, x.device)
        if per > 1:
            ssm_state, A = _regroup(ssm_state, 1, per), _regroup(A, 0, per)
            x, dt, z, y_out = (_regroup(t, 1, per) for t in (x, dt, z, y))
            D, dt_bias = _regroup(D, 0, per), _regroup(dt_bias, 0, per)
            H, P = H // per, per
    tied = (
        dt_proj_weight is None
        and dt.stride(2) == 0
        and A.stride(1) == 0
        and A.stride(2) == 0
        and _tied_over_p(D, (1,))
        and _tied_over_p(dt_bias, (1,))
    )
    block_n = next_pow2(N)
    cfg = update_launch_config(P, N, config)
    block_p = cfg["block_p"]
    lo, hi = dt_limit
    rounding = 0
    if _stochastic_rounding(ssm_state, rounding_offsets):
        rounding = 1 if ssm_state.dtype == torch.bfloat16 else 2
    zeros3 = (0, 0, 0)
    grid = (cdiv(P, block_p), H, Bt)
    _state_update_kernel[grid](
        ssm_state,
        x,
        low_rank,
        A,
        B,
        C,
        D,
        z,
        dt_bias,
        y_out,
        state_slots,
        rounding_offsets if rounding else None,
        launch_seed(rounding_seed),
        H // G,
        P,
        N,
        float(lo),
        float(hi),
        *ssm_state.stride(),
        *x.stride(),
        *(dt.stride() if dt_proj_weight is None else (*low_rank.stride(), 0)),
        *A.stride(),
        *B.stride(),
        *C.stride(),
        *(D.stride() if D is not None else (0, 0)),
        *(z.stride() if z is not None else zeros3),
        *(dt_bias.stride() if dt_bias is not None else (0, 0)),
        *y_out.stride(),
        dt_proj_weight,
        low_rank.shape[1] if dt_proj_weight is not None else 0,
        *(dt_proj_weight.stride() if dt_proj_weight is not None else (0, 0)),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus,
        CLAMP_DT=lo > 0.0 or hi < math.inf,
        TIED=tied,
        ROUNDING=rounding,
        DT_PROJ=dt_proj_weight is not None,
        BLOCK_R=next_pow2(low_rank.shape[1]) if dt_proj_weight is not None else 1,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=cfg["num_warps"],
        PDL=pdl,
        **pdl_launch(pdl),
    )
    return y
