"""One Mamba2 decode token in one launch: the causal conv1d update of x, B and C, then the
selective state update, state addressed by slot.

Per sequence (row b, slot s), with xbc[b] = x (H * P channels) ++ B (G * N) ++ C (G * N):

    window  = conv_state[s] ++ xbc[b]                        [conv_dim, K], oldest first
    u       = act(conv_bias + sum_k conv_weight[:, k] * window[:, k])    in xbc's dtype
    conv_state[s] = window[:, 1:]
    x, B, C = u split as xbc;  g = h // (H // G)
    dt      = clamp(softplus(dt[b, h] + dt_bias[h]), *dt_limit)
    S       = exp(dt * A[h]) * S + dt * x[h, p] * B[g, n]                 S = ssm_state[s]
    y       = sum_n S[h, p, n] * C[g, n] + D[h] * x[h, p];  y *= silu(z[b, h, p])

which is `causal_conv1d_update` followed by `selective_state_update` on Mamba2's per-head
dt, A, D and dt_bias; the twin is exactly those two twins. The Triton kernel keeps u in
registers: it never goes to global memory. See docs/kernels.md, "Fused Mamba2 decode".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

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
from ssmserve.kernels.causal_conv1d import causal_conv1d_update_ref, conv_apply, conv_inputs
from ssmserve.kernels.state_update import selective_state_update_ref
from ssmserve.kernels.stochastic_rounding import (
    ROUNDED_DTYPES,
    launch_seed,
    store_state,
)

_ACTIVATIONS = (None, "silu", "swish")


def _check_decode_args(
    xbc: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    n_groups: int,
    activation: str | None,
    state_slots: torch.Tensor,
    rounding_offsets: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes; return (Bt, H, P, G, N, K)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    check_shape("xbc", xbc, [None, None])
    Bt, conv_dim = xbc.shape
    check_shape("ssm_state", ssm_state, [None, None, None, None])
    rows, H, P, N = ssm_state.shape
    G = n_groups
    if G <= 0 or H % G != 0:
        raise ValueError(f"number of heads ({H}) must be a multiple of n_groups ({G})")
    if conv_dim != H * P + 2 * G * N:
        raise ValueError(
            f"xbc has {conv_dim} channels; heads x head dim + 2 x n_groups x d_state = "
            f"{H} x {P} + 2 x {G} x {N} = {H * P + 2 * G * N}"
        )
    check_shape("conv_weight", conv_weight, [conv_dim, None])
    K = conv_weight.shape[1]
    if K < 2:
        raise ValueError(f"conv kernel width must be >= 2, got {K}")
    if conv_bias is not None:
        check_shape("conv_bias", conv_bias, [conv_dim])
    check_shape("conv_state", conv_state, [rows, conv_dim, K - 1])
    check_shape("dt", dt, [Bt, H])
    check_shape("A", A, [H])
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            check_shape(name, t, [H])
    if z is not None:
        check_shape("z", z, [Bt, H, P])
    check_shape("state_slots", state_slots, [Bt])
    if rounding_offsets is not None:
        check_shape("rounding_offsets", rounding_offsets, [Bt])
    return Bt, H, P, G, N, K


def mamba2_decode_update_ref(
    xbc: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    n_groups: int,
    activation: str | None = "silu",
    state_slots: torch.Tensor,
    rounding_offsets: torch.Tensor | None = None,
    rounding_seed: int = 0,
    pdl: bool = False,
) -> torch.Tensor:
    """One Mamba2 decode token (conv update, then state update), in place on both pools.
    `pdl` is the Triton launcher's.

    Args:
        xbc: [Bt, conv_dim] the conv inputs, x (H * P) ++ B (G * N) ++ C (G * N) channels,
            conv_dim = H * P + 2 * G * N (any row stride).
        conv_state: [num_slots, conv_dim, K-1] pool, oldest input first; shifted in place.
        conv_weight: [conv_dim, K]. conv_bias: [conv_dim] or None.
        ssm_state: [num_slots, H, P, N] pool (float32 or 16-bit), updated in place.
        dt: [Bt, H]. A: [H] float32 (= -exp(A_log)). D, dt_bias: [H] or None.
        z: [Bt, H, P] or None (y gated by silu(z)).
        n_groups: G, the B/C groups (H a multiple of G; head h reads group h // (H // G)).
        activation: the conv's, "silu" (or "swish") or None.
        state_slots: [Bt] int; entries < 0 are padding: both states untouched, output 0.
        rounding_offsets, rounding_seed: stochastic rounding of a 16-bit `ssm_state`, as
            in `selective_state_update`.

    Returns:
        y: [Bt, H, P] in xbc.dtype.
    """
    _check_decode_args(
        xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, z, dt_bias,
        n_groups, activation, state_slots, rounding_offsets,
    )  # fmt: skip
    return conv_then_state_update(
        causal_conv1d_update_ref,
        selective_state_update_ref,
        xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, z,
        dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, n_groups=n_groups,
        activation=activation, state_slots=state_slots, rounding_offsets=rounding_offsets,
        rounding_seed=rounding_seed,
    )  # fmt: skip


def conv_then_state_update(
    conv_update: Callable[..., torch.Tensor],
    state_update: Callable[..., torch.Tensor],
    xbc: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    n_groups: int,
    activation: str | None = "silu",
    state_slots: torch.Tensor,
    **state_update_options: Any,
) -> torch.Tensor:
    """The decode step as two ops, `mamba2_decode_update`'s arguments: `conv_update`
    (a `causal_conv1d_update`) writes x, B and C to memory, then `state_update` (a
    `selective_state_update`) reads them, with dt, A, D and dt_bias expanded per head.
    Over the twins it is the fused op's twin; over the Triton kernels, the two launches
    the fused kernel replaces (benchmarks and tests compare with them).
    """
    Bt, (_, H, P, N), G = xbc.shape[0], ssm_state.shape, n_groups
    u = conv_update(
        xbc, conv_state, conv_weight, conv_bias, state_slots=state_slots, activation=activation
    )
    x, B, C = u.split([H * P, G * N, G * N], dim=-1)
    return state_update(
        ssm_state,
        x.view(Bt, H, P),
        dt[:, :, None].expand(Bt, H, P),
        A[:, None, None].expand(H, P, N),
        B.view(Bt, G, N),
        C.view(Bt, G, N),
        D[:, None].expand(H, P) if D is not None else None,
        z,
        dt_bias=dt_bias[:, None].expand(H, P) if dt_bias is not None else None,
        state_slots=state_slots,
        **state_update_options,
    )


# ---------------------------------------------------------------------------- Triton


@device_function
def _head_inputs(
    dt_ptr,
    z_ptr,
    A_ptr,
    D_ptr,
    dt_bias_ptr,
    row,
    head,
    offs_p,
    mask_p,
    valid,
    stride_dt_b,
    stride_dt_h,
    stride_z_b,
    stride_z_h,
    stride_z_p,
    stride_a_h,
    stride_d_h,
    stride_bias_h,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
):
    # What one head's state update reads besides its state and the conv outputs, in
    # float32: dt + dt_bias (before softplus), A, D and the gate z (zeros without them).
    dt_at = dt_ptr + row * stride_dt_b + head * stride_dt_h
    dt = tl.load(dt_at, mask=valid, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + head * stride_bias_h, mask=valid, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + head * stride_a_h, mask=valid, other=0.0).to(tl.float32)
    d = dt * 0.0
    if HAS_D:
        d = tl.load(D_ptr + head * stride_d_h, mask=valid, other=0.0).to(tl.float32)
    zv = tl.zeros_like(offs_p).to(tl.float32)
    if HAS_Z:
        z_at = z_ptr + row * stride_z_b + head * stride_z_h + offs_p * stride_z_p
        zv = tl.load(z_at, mask=mask_p & valid, other=0.0).to(tl.float32)
    return dt, a, d, zv


# Not specialised, as in the unfused kernels: the slots and positions (views into the
# step's packed inputs), the per-layer rounding key, the batch strides (a one-row batch
# gets contiguous strides from torch) and the per-batch program layout.
@lazy_jit(
    do_not_specialize=(
        "state_slots_ptr",
        "rounding_offsets_ptr",
        "rounding_seed",
        "heads_per_program",
        "arrivals_per_group",
        "stride_xbc_b",
        "stride_dt_b",
        "stride_z_b",
        "stride_y_b",
    )
)
def _mamba2_decode_kernel(
    xbc_ptr,
    conv_state_ptr,
    conv_weight_ptr,
    conv_bias_ptr,
    ssm_state_ptr,
    dt_ptr,
    A_ptr,
    D_ptr,
    z_ptr,
    dt_bias_ptr,
    y_ptr,
    state_slots_ptr,
    rounding_offsets_ptr,
    rounding_seed,
    arrivals_ptr,
    n_groups,
    heads_per_group,
    num_p_blocks,
    heads_per_program,
    arrivals_per_group,
    P,
    N,
    dt_min,
    dt_max,
    stride_xbc_b,
    stride_xbc_c,
    stride_cs_slot,
    stride_cs_c,
    stride_cs_k,
    stride_w_c,
    stride_w_k,
    stride_cb,
    stride_ss_slot,
    stride_ss_h,
    stride_ss_p,
    stride_ss_n,
    stride_dt_b,
    stride_dt_h,
    stride_a_h,
    stride_d_h,
    stride_bias_h,
    stride_z_b,
    stride_z_h,
    stride_z_p,
    stride_y_b,
    stride_y_h,
    stride_y_p,
    KM1: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    CLAMP_DT: tl.constexpr,
    ROUNDING: tl.constexpr,  # 0: to nearest; stochastic, 1: to bfloat16, 2: to float16
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (head-dim block x run of `heads_per_program` heads, group, row).
    # It computes its group's B and C conv once, then walks its heads: it owns their x
    # channels (head * P + offs_p) outright; the B and C channels it shares with the
    # other `arrivals_per_group` programs of (row, group).
    pid = tl.program_id(0)
    group = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    pid_p = pid % num_p_blocks
    first_head = group * heads_per_group + (pid // num_p_blocks) * heads_per_program
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    valid = slot >= 0

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :] & valid
    state_tile = (
        ssm_state_ptr
        + slot * stride_ss_slot
        + offs_p[:, None] * stride_ss_p
        + offs_n[None, :] * stride_ss_n
    )
    xbc_row = xbc_ptr + row * stride_xbc_b
    conv_row = conv_state_ptr + slot * stride_cs_slot
    x_dim = n_groups * heads_per_group * P
    b_channels = x_dim + group * N + offs_n
    c_channels = x_dim + (n_groups + group) * N + offs_n
    x_channels = first_head * P + offs_p
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < KM1
    conv_args = (stride_cs_c, stride_cs_k, stride_w_c, stride_w_k, stride_cb)
    if PDL:
        # Before the wait, what no kernel of the step writes: the slots (the step's
        # input), the weights, and this layer's conv windows and state, written only by
        # this kernel's launch of the step before (complete: every step has launches
        # that wait for all before them). After it, the step's inputs only.
        gdc_launch_dependents()
        next_state = tl.load(state_tile + first_head * stride_ss_h, mask=mask_pn, other=0.0)
    b_in = conv_inputs(
        conv_row, conv_weight_ptr, conv_bias_ptr, b_channels, mask_n, valid, *conv_args,
        KM1, HAS_CONV_BIAS, BLOCK_K,
    )  # fmt: skip
    c_in = conv_inputs(
        conv_row, conv_weight_ptr, conv_bias_ptr, c_channels, mask_n, valid, *conv_args,
        KM1, HAS_CONV_BIAS, BLOCK_K,
    )  # fmt: skip
    # The x conv's inputs are loaded one head ahead, like the state.
    next_x_in = conv_inputs(
        conv_row, conv_weight_ptr, conv_bias_ptr, x_channels, mask_p, valid, *conv_args,
        KM1, HAS_CONV_BIAS, BLOCK_K,
    )  # fmt: skip
    if PDL:
        gdc_wait()
    b_x = tl.load(xbc_row + b_channels * stride_xbc_c, mask=mask_n & valid, other=0.0)
    c_x = tl.load(xbc_row + c_channels * stride_xbc_c, mask=mask_n & valid, other=0.0)
    next_x = tl.load(xbc_row + x_channels * stride_xbc_c, mask=mask_p & valid, other=0.0)
    # The first head's dt, gate and per-head weights are loaded here, with x, B and C:
    # the compiler cannot move a load above the window and state stores below (for all
    # it knows they alias), so loaded in the head's turn each would be one more round
    # trip after them. Later heads' are loaded one head ahead, like the state.
    head_strides = (
        stride_dt_b, stride_dt_h, stride_z_b, stride_z_h, stride_z_p, stride_a_h, stride_d_h,
        stride_bias_h,
    )  # fmt: skip
    next_head = _head_inputs(
        dt_ptr, z_ptr, A_ptr, D_ptr, dt_bias_ptr, row, first_head, offs_p, mask_p, valid,
        *head_strides, HAS_D, HAS_Z, HAS_DT_BIAS,
    )  # fmt: skip
    out_dtype = xbc_ptr.dtype.element_ty
    b, b_window = conv_apply(b_x, *b_in, out_dtype, KM1, HAS_CONV_BIAS, SILU, BLOCK_K)
    c, c_window = conv_apply(c_x, *c_in, out_dtype, KM1, HAS_CONV_BIAS, SILU, BLOCK_K)

    # NOTE: the ordering that makes the B/C conv state write safe. Every one of the
    # `arrivals_per_group` programs of (row, group) reads the old B/C window, so only the
    # last of them to get here writes the new one. The barrier puts all of this
    # program's window loads before the acq_rel increment of the (slot, group) counter
    # (made by one thread). The increments form one release sequence, so the program
    # that reads count == arrivals - 1 acquires every other program's release: their
    # window loads happen before its stores and cannot see the new window. The barrier
    # after the atomic extends that acquire to all of the last program's threads. Nobody
    # waits, so no launch order can deadlock; padding rows (slot < 0) take no part.
    # The last program resets the counter to 0: every valid (slot, group) of a launch sees
    # exactly `arrivals_per_group` increments, so each launch leaves the buffer all
    # zeros, as the next one (the next layer, a CUDA-graph replay) needs it. Slots are
    # distinct within a launch, as the state writes already require.
    # Without PDL the atomic comes before any state load, so its release waits on the
    # small window loads only, and its round trip is paid once per run of heads, not once
    # per head.
    # Ordering bugs show deterministically in the interpreter, which runs the programs
    # one after another: a B/C window written early is read shifted by the later programs
    # of the group (y and the state change), and a count that never reaches the last
    # program leaves the old window (the conv state changes) or the counter non-zero.
    tl.debug_barrier()
    counter = arrivals_ptr + tl.maximum(slot, 0) * n_groups + group
    arrived = tl.atomic_add(counter, 1, mask=valid, sem="acq_rel", scope="gpu")
    last = valid & (arrived == arrivals_per_group - 1)
    tl.debug_barrier()
    mask_nk = mask_n[:, None] & mask_k[None, :] & last
    window_k = offs_k[None, :] * stride_cs_k
    tl.store(conv_row + b_channels[:, None] * stride_cs_c + window_k, b_window, mask=mask_nk)
    tl.store(conv_row + c_channels[:, None] * stride_cs_c + window_k, c_window, mask=mask_nk)
    tl.store(counter, 0, mask=last)

    # Each head's state and conv inputs are loaded one head ahead, so loads are in
    # flight while the previous head computes.
    if not PDL:
        next_state = tl.load(state_tile + first_head * stride_ss_h, mask=mask_pn, other=0.0)
    for i in range(heads_per_program):
        head = first_head + i
        more = i + 1 < heads_per_program
        state = next_state.to(tl.float32)
        next_state = tl.load(state_tile + (head + 1) * stride_ss_h, mask=mask_pn & more, other=0.0)
        x, x_window = conv_apply(
            next_x, *next_x_in, out_dtype, KM1, HAS_CONV_BIAS, SILU, BLOCK_K
        )  # fmt: skip
        x_channels = head * P + offs_p
        next_channels = x_channels + P
        next_x_in = conv_inputs(
            conv_row, conv_weight_ptr, conv_bias_ptr, next_channels, mask_p & more, valid,
            *conv_args, KM1, HAS_CONV_BIAS, BLOCK_K,
        )  # fmt: skip
        next_x = tl.load(
            xbc_row + next_channels * stride_xbc_c, mask=mask_p & more & valid, other=0.0
        )
        dt, a, d, zv = next_head
        next_head = _head_inputs(
            dt_ptr, z_ptr, A_ptr, D_ptr, dt_bias_ptr, row, head + 1, offs_p, mask_p & more,
            valid & more, *head_strides, HAS_D, HAS_Z, HAS_DT_BIAS,
        )  # fmt: skip

        # The state update on the conv outputs in registers (per-head dt, A, D, dt_bias).
        if DT_SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        if CLAMP_DT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        decay = tl.exp(dt * a)
        state = state * decay + (dt * x)[:, None] * b[None, :]
        state_ptrs = state_tile + head * stride_ss_h
        store_state(
            ssm_state_ptr, state_ptrs, state, mask_pn, rounding_offsets_ptr, row,
            rounding_seed, head, P, N, offs_p, offs_n, ROUNDING,
        )  # fmt: skip

        y = tl.sum(state * c[None, :], axis=1)
        if HAS_D:
            y += d * x
        if HAS_Z:
            y *= zv / (1.0 + tl.exp(-zv))
        y = tl.where(valid, y, 0.0)
        tl.store(
            y_ptr + row * stride_y_b + head * stride_y_h + offs_p * stride_y_p,
            y.to(y_ptr.dtype.element_ty),
            mask=mask_p,
        )
        # NOTE: only this program reads and writes this head's x channels, but its
        # threads hold other parts of the window than they store: every thread's read
        # must land before any thread's write.
        tl.debug_barrier()
        mask_pk = mask_p[:, None] & mask_k[None, :] & valid
        tl.store(conv_row + x_channels[:, None] * stride_cs_c + window_k, x_window, mask=mask_pk)


def decode_update_launch_config(
    P: int,
    N: int,
    heads_per_group: int,
    num_row_groups: int,
    device: torch.device,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Launch parameters for head dim P, state dim N, `heads_per_group` heads per B/C
    group and `num_row_groups` (batch rows x groups), `config` overriding the defaults
    (benchmarks/kernels/bench_mamba2_decode.py sweeps them).

    block_p: head-dim rows per program.
    heads_per_program: heads each program walks (a divisor of `heads_per_group`). The
        default is the most that still leaves about 8 programs per SM (on CPU, one head):
        more heads per program mean fewer programs sharing, and counting on, each
        (row, group)'s B/C window, and the B/C conv computed fewer times.
    num_warps: warps per program.
    """
    default = {
        "block_p": min(next_pow2(P), max(1, 4096 // next_pow2(N))),
        "heads_per_program": 1,
        "num_warps": 4,
    }
    cfg = launch_config("mamba2_decode_update", default, config)
    if device.type == "cuda" and "heads_per_program" not in (config or {}):
        programs_per_head = num_row_groups * -(-P // cfg["block_p"])
        target = 8 * num_sms(device)
        cfg["heads_per_program"] = max(
            d
            for d in range(1, heads_per_group + 1)
            if heads_per_group % d == 0
            and (d == 1 or programs_per_head * (heads_per_group // d) >= target)
        )
    if heads_per_group % cfg["heads_per_program"]:
        raise ValueError(
            f"mamba2_decode_update: heads_per_program = {cfg['heads_per_program']} must "
            f"divide the {heads_per_group} heads of a group"
        )
    return cfg


# NOTE: the (slot, group) arrival counters: one int32 buffer per device, shared by every
# layer and launch, all zeros between launches (each launch resets what it counts).
# Launches on one stream touch them one after another (with programmatic dependent
# launch too: a kernel touches them only after its `gdc_wait()`), so sharing is safe. A
# buffer is never freed, because a captured CUDA graph keeps the address it was captured
# with, and never allocated while a graph is being captured.
_ARRIVAL_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, numel: int) -> torch.Tensor:
    buffers = _ARRIVAL_COUNTERS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= numel:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"mamba2_decode_update needs {numel} arrival counters (state rows x n_groups), "
            "which are allocated at the first eager call with that state pool; make one "
            "eager call before capturing the CUDA graph"
        )
    buffers.append(torch.zeros(max(1024, next_pow2(numel)), dtype=torch.int32, device=device))
    return buffers[-1]


def mamba2_decode_update_triton(
    xbc: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    n_groups: int,
    activation: str | None = "silu",
    state_slots: torch.Tensor,
    rounding_offsets: torch.Tensor | None = None,
    rounding_seed: int = 0,
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `mamba2_decode_update_ref` (same arguments, shapes and result), one
    launch. No host sync: safe under CUDA graphs once called eagerly with the state pool
    (see `_arrival_counters`). `pdl`: launch with programmatic dependent launch (sm_90);
    each program loads its first head's state before waiting for the kernel before it.
    `config` overrides launch parameters (see `decode_update_launch_config`; benchmarks
    and tests only).
    """
    Bt, H, P, G, N, K = _check_decode_args(
        xbc, conv_state, conv_weight, conv_bias, ssm_state, dt, A, D, z, dt_bias,
        n_groups, activation, state_slots, rounding_offsets,
    )  # fmt: skip
    y = torch.empty(Bt, H, P, dtype=xbc.dtype, device=xbc.device)
    if Bt == 0:
        return y
    cfg = decode_update_launch_config(P, N, H // G, Bt * G, xbc.device, config)
    block_p, heads_per_program = cfg["block_p"], cfg["heads_per_program"]
    arrivals = _arrival_counters(ssm_state.device, ssm_state.shape[0] * G)
    lo, hi = dt_limit
    rounding = 0
    if rounding_offsets is not None and ssm_state.dtype in ROUNDED_DTYPES:
        rounding = 1 if ssm_state.dtype == torch.bfloat16 else 2
    num_p_blocks = cdiv(P, block_p)
    programs_per_group = num_p_blocks * (H // G // heads_per_program)
    grid = (programs_per_group, G, Bt)
    _mamba2_decode_kernel[grid](
        xbc,
        conv_state,
        conv_weight,
        conv_bias,
        ssm_state,
        dt,
        A,
        D,
        z,
        dt_bias,
        y,
        state_slots,
        rounding_offsets if rounding else None,
        launch_seed(rounding_seed),
        arrivals,
        G,
        H // G,
        num_p_blocks,
        heads_per_program,
        programs_per_group,
        P,
        N,
        float(lo),
        float(hi),
        *xbc.stride(),
        *conv_state.stride(),
        *conv_weight.stride(),
        conv_bias.stride(0) if conv_bias is not None else 0,
        *ssm_state.stride(),
        *dt.stride(),
        A.stride(0),
        D.stride(0) if D is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0,
        *(z.stride() if z is not None else (0, 0, 0)),
        *y.stride(),
        KM1=K - 1,
        HAS_CONV_BIAS=conv_bias is not None,
        SILU=activation is not None,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus,
        CLAMP_DT=lo > 0.0 or hi < math.inf,
        ROUNDING=rounding,
        BLOCK_P=block_p,
        BLOCK_N=next_pow2(N),
        BLOCK_K=next_pow2(K - 1),
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return y
