"""Mamba1 prefill: variable-length selective scan.

Per channel d and state index n, for each token t of a sequence:

    delta_t = softplus(delta_t + delta_bias)          (softplus if delta_softplus)
    h_t     = exp(delta_t * A[d, n]) * h_{t-1} + delta_t * u_t * B_t[n]
    y_t     = sum_n h_t[n] * C_t[n] + D[d] * u_t;   y_t *= silu(z_t) if z is given

h_{-1} is the slot state if has_initial_state else zeros; the final h goes back to
the slot. Snapshots (prefix caching) also write h after the first k tokens of a sequence
into other rows of the state pool, at any k.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    as_int8,
    cdiv,
    check_shape,
    check_snapshot_shapes,
    check_snapshots,
    check_varlen,
    check_varlen_shapes,
    device_function,
    interpret_mode,
    launch_config,
    lazy_jit,
    next_pow2,
    num_sms,
    tl,
)

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
    snapshot_seqs: torch.Tensor | None = None,
    snapshot_lens: torch.Tensor | None = None,
    snapshot_slots: torch.Tensor | None = None,
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
        snapshot_seqs, snapshot_lens, snapshot_slots: [M] int each, or None (all three or
            none): ssm_state[snapshot_slots[i]] receives the state of sequence
            snapshot_seqs[i] after its first snapshot_lens[i] tokens (1 <= lens <= its
            length; rows that no sequence of the call uses; sorted by sequence, then
            length, for the Triton kernel).

    Returns:
        y: [T, Dm] in u.dtype.
    """
    T, Dm, N = _check_selective_scan_args(u, delta, A, B, C, D, ssm_state, z, delta_bias)
    check_snapshot_shapes(snapshot_seqs, snapshot_lens, snapshot_slots)
    seqs = check_varlen(cu_seqlens, state_slots, has_initial_state, T, ssm_state.shape[0])
    cuts = check_snapshots(snapshot_seqs, snapshot_lens, snapshot_slots, seqs, ssm_state.shape[0])
    delta_f = delta.float()
    if delta_bias is not None:
        delta_f = delta_f + delta_bias.float()
    if delta_softplus:
        delta_f = F.softplus(delta_f)
    A_f = A.float()
    y = torch.empty(T, Dm, dtype=torch.float32, device=u.device)
    for index, (start, end, slot, has_init) in enumerate(seqs):
        state = ssm_state[slot].float() if has_init else u.new_zeros(Dm, N, dtype=torch.float32)
        snaps = cuts.get(index, {})
        # Blocks end every _REF_BLOCK tokens and at snapshots.
        ends = {*range(start + _REF_BLOCK, end, _REF_BLOCK), *(start + k for k in snaps)}
        ends = sorted(ends - {end})
        for c0, c1 in zip([start, *ends], [*ends, end], strict=True):
            decay = torch.exp(delta_f[c0:c1, :, None] * A_f)  # [L, Dm, N]
            states = (delta_f[c0:c1] * u[c0:c1].float())[:, :, None] * B[c0:c1, None, :].float()
            # A per-token loop of one fused multiply-add on a [Dm, N] state that stays in
            # cache: with N = 16 this beats any pairwise (chunked-matmul) form on CPU.
            for t in range(c1 - c0):
                torch.addcmul(states[t], decay[t], state, out=states[t])
                state = states[t]
            y[c0:c1] = torch.einsum("tdn,tn->td", states, C[c0:c1].float())
            state = state.clone()
            if c1 - start in snaps:
                ssm_state[snaps[c1 - start]] = state.to(ssm_state.dtype)
        ssm_state[slot] = state.to(ssm_state.dtype)
    if D is not None:
        y += D.float() * u.float()
    if z is not None:
        y *= F.silu(z.float())
    return y.to(u.dtype)


# ---------------------------------------------------------------------------- Triton
#
# One program per (channel block, sequence) walks its sequence in blocks of BLOCK_T
# tokens. Within a block the recurrence h_t = a_t * h_{t-1} + b_t is an associative scan
# over the token axis; the state carried from the previous block enters through the
# block's first token, so the scanned values are the states themselves.
# Block tensors are [BLOCK_T, N_OUTER, BLOCK_D, N_INNER] (the state axis split in two).
# Triton's default layout for that shape keeps BLOCK_T x N_OUTER in each thread's
# registers and spreads BLOCK_D and N_INNER over lanes and warps: the scan is then a
# chain of FMAs in registers, and y = sum_n h * C is in-thread FMAs plus log2(N_INNER)
# shuffles. Spreading N over N_INNER lanes multiplies the threads per sequence by
# N_INNER: one Mamba-2.8B sequence has only 5120 channels.
# The floor is arithmetic, not memory: one exp per (token, channel, state entry), and the
# GPU's special-function units do 16 per clock per SM (for N = 16 that is about twice
# the time of reading and writing u, delta, z and y once).
# Each block's inputs are loaded while the previous block is computed.


@device_function
def _first_order_combine(decay_1, value_1, decay_2, value_2):
    # The map h -> decay_1 * h + value_1 followed by h -> decay_2 * h + value_2.
    return decay_1 * decay_2, decay_2 * value_1 + value_2


@lazy_jit(
    do_not_specialize=(
        "cu_seqlens_ptr",
        "state_slots_ptr",
        "has_init_ptr",
        "snapshot_seqs_ptr",
        "snapshot_lens_ptr",
        "snapshot_slots_ptr",
        "num_snapshots",
    )
)
def _selective_scan_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    z_ptr,
    delta_bias_ptr,
    y_ptr,
    state_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_init_ptr,
    snapshot_seqs_ptr,
    snapshot_lens_ptr,
    snapshot_slots_ptr,
    num_snapshots,
    Dm,
    N,
    stride_u_t,
    stride_u_d,
    stride_delta_t,
    stride_delta_d,
    stride_a_d,
    stride_a_n,
    stride_b_t,
    stride_b_n,
    stride_c_t,
    stride_c_n,
    stride_z_t,
    stride_z_d,
    stride_y_t,
    stride_y_d,
    stride_s_slot,
    stride_s_d,
    stride_s_n,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DELTA_BIAS: tl.constexpr,
    DELTA_SOFTPLUS: tl.constexpr,
    FAST_LOG: tl.constexpr,
    HAS_SNAPSHOTS: tl.constexpr,
    BLOCK_SNAPSHOTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_INNER: tl.constexpr,
):
    pid_d = tl.program_id(0)
    seq = tl.program_id(1)
    N_OUTER: tl.constexpr = BLOCK_N // N_INNER
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, N_OUTER)[:, None] * N_INNER + tl.arange(0, N_INNER)[None, :]
    mask_d = offs_d < Dm
    mask_n = offs_n < N
    # State-shaped tensors are [N_OUTER, BLOCK_D, N_INNER].
    mask_dn = mask_n[:, None, :] & mask_d[None, :, None]
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    state_ptrs = (
        state_ptr
        + slot * stride_s_slot
        + offs_d[None, :, None] * stride_s_d
        + offs_n[:, None, :] * stride_s_n
    )
    h = tl.load(state_ptrs, mask=mask_dn & has_init, other=0.0).to(tl.float32)
    # Gives the carried state the layout the loop produces it in (a reduction over the
    # token axis), so it is not converted twice per block.
    h = tl.sum(h[None, :, :, :], axis=0)
    A = tl.load(
        A_ptr + offs_d[None, :, None] * stride_a_d + offs_n[:, None, :] * stride_a_n,
        mask=mask_dn,
        other=0.0,
    ).to(tl.float32)
    A_log2 = A * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    if HAS_DELTA_BIAS:
        delta_bias = tl.load(delta_bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)

    # Pointers to the first block; each block's inputs are loaded one block ahead.
    rows = start + offs_t
    u_ptrs = u_ptr + rows[:, None] * stride_u_t + offs_d[None, :] * stride_u_d
    delta_ptrs = delta_ptr + rows[:, None] * stride_delta_t + offs_d[None, :] * stride_delta_d
    b_ptrs = B_ptr + rows[:, None, None] * stride_b_t + offs_n[None, :, :] * stride_b_n
    c_ptrs = C_ptr + rows[:, None, None] * stride_c_t + offs_n[None, :, :] * stride_c_n
    y_ptrs = y_ptr + rows[:, None] * stride_y_t + offs_d[None, :] * stride_y_d
    mask_t = rows < end
    mask_td = mask_t[:, None] & mask_d[None, :]
    mask_tn = mask_t[:, None, None] & mask_n[None, :, :]
    u_next = tl.load(u_ptrs, mask=mask_td, other=0.0)
    delta_next = tl.load(delta_ptrs, mask=mask_td, other=0.0)
    b_next = tl.load(b_ptrs, mask=mask_tn, other=0.0)
    c_next = tl.load(c_ptrs, mask=mask_tn, other=0.0)
    if HAS_Z:
        z_ptrs = z_ptr + rows[:, None] * stride_z_t + offs_d[None, :] * stride_z_d
        z_next = tl.load(z_ptrs, mask=mask_td, other=0.0)
    if HAS_SNAPSHOTS:
        # This sequence's snapshots are entries snapshot:snapshot_end (they are sorted by
        # sequence, then length): counted here, so the launcher needs no search kernel.
        snapshot = 0
        snapshot_end = 0
        for m0 in range(0, num_snapshots, BLOCK_SNAPSHOTS):
            offs_m = m0 + tl.arange(0, BLOCK_SNAPSHOTS)
            mask_m = offs_m < num_snapshots
            snap_seq = tl.load(snapshot_seqs_ptr + offs_m, mask=mask_m, other=0)
            snapshot += tl.sum((mask_m & (snap_seq < seq)).to(tl.int32), 0)
            snapshot_end += tl.sum((mask_m & (snap_seq <= seq)).to(tl.int32), 0)
        # The next one's length, or one that no block reaches when there is none.
        next_len = tl.load(
            snapshot_lens_ptr + snapshot, mask=snapshot < snapshot_end, other=end - start + BLOCK_T
        )
    for t0 in range(start, end, BLOCK_T):
        u = u_next.to(tl.float32)
        delta = delta_next.to(tl.float32)
        b = b_next.to(tl.float32)
        c = c_next.to(tl.float32)
        if HAS_Z:
            z = z_next.to(tl.float32)
        mask_t = t0 + offs_t < end
        mask_td = mask_t[:, None] & mask_d[None, :]
        mask_next = t0 + BLOCK_T + offs_t < end
        mask_next_td = mask_next[:, None] & mask_d[None, :]
        mask_next_tn = mask_next[:, None, None] & mask_n[None, :, :]
        u_ptrs += BLOCK_T * stride_u_t
        delta_ptrs += BLOCK_T * stride_delta_t
        b_ptrs += BLOCK_T * stride_b_t
        c_ptrs += BLOCK_T * stride_c_t
        u_next = tl.load(u_ptrs, mask=mask_next_td, other=0.0)
        delta_next = tl.load(delta_ptrs, mask=mask_next_td, other=0.0)
        b_next = tl.load(b_ptrs, mask=mask_next_tn, other=0.0)
        c_next = tl.load(c_ptrs, mask=mask_next_tn, other=0.0)
        if HAS_Z:
            z_ptrs += BLOCK_T * stride_z_t
            z_next = tl.load(z_ptrs, mask=mask_next_td, other=0.0)

        if HAS_DELTA_BIAS:
            delta += delta_bias[None, :]
        if DELTA_SOFTPLUS:
            if FAST_LOG:
                # The interpreter has no inline PTX; tl.log is a ~20-instruction routine.
                log2_1p = tl.inline_asm_elementwise(
                    "lg2.approx.f32 $0, $1;",
                    "=r,r",
                    [1.0 + tl.exp(delta)],
                    dtype=tl.float32,
                    is_pure=True,
                    pack=1,
                )
                delta = tl.where(delta <= 20.0, log2_1p * 0.6931471805599453, delta)
            else:
                delta = tl.where(delta <= 20.0, tl.log(1.0 + tl.exp(delta)), delta)
        # Tokens past the end neither decay nor add: the block's last state is the final one.
        delta = tl.where(mask_t[:, None], delta, 0.0)
        decay = tl.exp2(delta[:, None, :, None] * A_log2[None, :, :, :])
        value = (delta * u)[:, None, :, None] * b[:, :, None, :]
        first = offs_t[:, None, None, None] == 0
        value = tl.where(first, value + decay * h[None, :, :, :], value)
        _, hs = tl.associative_scan((decay, value), 0, _first_order_combine)
        y = tl.sum(tl.sum(hs * c[:, :, None, :], axis=1), axis=2)
        h = tl.sum(tl.where(offs_t[:, None, None, None] == BLOCK_T - 1, hs, 0.0), axis=0)
        if HAS_SNAPSHOTS:
            # Snapshots whose last token is in this block: the scanned state at that row.
            while next_len <= t0 - start + BLOCK_T:
                k = next_len - 1 - (t0 - start)
                h_k = tl.sum(tl.where(offs_t[:, None, None, None] == k, hs, 0.0), axis=0)
                row = tl.load(snapshot_slots_ptr + snapshot).to(tl.int64)
                tl.store(
                    state_ptr
                    + row * stride_s_slot
                    + offs_d[None, :, None] * stride_s_d
                    + offs_n[:, None, :] * stride_s_n,
                    h_k.to(state_ptr.dtype.element_ty),
                    mask=mask_dn,
                )
                snapshot += 1
                next_len = tl.load(
                    snapshot_lens_ptr + snapshot,
                    mask=snapshot < snapshot_end,
                    other=end - start + BLOCK_T,
                )
        if HAS_D:
            y += D[None, :] * u
        if HAS_Z:
            y *= z / (1.0 + tl.exp(-z))
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_td)
        y_ptrs += BLOCK_T * stride_y_t
    tl.store(state_ptrs, h.to(state_ptr.dtype.element_ty), mask=mask_dn)


def scan_launch_config(
    S: int,
    Dm: int,
    N: int,
    device: torch.device,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Launch parameters for S sequences, Dm channels and N state entries, `config`
    overriding the defaults (benchmarks/kernels/bench_selective_scan.py sweeps them).

    block_t: tokens per scan block (registers grow with it). Not cut down to short
        calls: its two defaults are the kernel's only variants over batch shapes (a
        short call masks the rest of its one block).
    n_inner: state entries spread over lanes; the other N / n_inner stay in registers.
    block_d: channels per program; a warp spans 32 // n_inner of them, so the default
        gives every thread one channel.
    num_warps: warps per program.
    float_bc: convert B and C to float32 before the kernel. Every thread converts every
        B and C entry it uses, and [T, N] is tiny next to [T, Dm]: the conversions are
        about 15% of the loop's instructions (ptxas, sm_90).

    Few sequences mean few programs; then 2-warp programs with 16-token blocks spread
    more evenly over the SMs. On the H200 at Mamba-2.8B dims and 8k tokens, one sequence
    takes 0.88 ms with 16-token 2-warp programs against 1.07 ms with 8-token 4-warp ones,
    eight sequences 0.51 ms with 8-token 4-warp programs against 0.54 and 0.56 ms with
    16-token blocks (benchmarks/results/selective_scan_2026-11-30_h200.json, sweep rows).
    """
    block_n = next_pow2(N)
    n_inner = min(4, block_n)
    few_programs = device.type == "cuda" and S * cdiv(Dm, 32) < 4 * num_sms(device)
    num_warps = 2 if few_programs else 4
    default = {
        "block_t": 16 if few_programs else 8,
        "block_d": min(32 // n_inner * num_warps, next_pow2(Dm)),
        "n_inner": n_inner,
        "num_warps": num_warps,
        "float_bc": True,
    }
    cfg = launch_config("selective_scan_varlen", default, config)
    if cfg["n_inner"] > block_n:
        raise ValueError(
            f"selective_scan_varlen: n_inner must be at most the padded state dim "
            f"({block_n}), got {cfg['n_inner']}"
        )
    return cfg


# Snapshots per step of the scan kernel's count of each sequence's own: one step for up
# to 64 (a 16k-token prefill at 256-token checkpoints).
_SNAPSHOT_BLOCK = 64


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
    snapshot_seqs: torch.Tensor | None = None,
    snapshot_lens: torch.Tensor | None = None,
    snapshot_slots: torch.Tensor | None = None,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `selective_scan_varlen_ref` (same arguments, shapes and result).

    No host sync; cu_seqlens, slot and snapshot values are not validated (slots must be
    valid and distinct, snapshots sorted by sequence, then length). `config` overrides
    launch parameters (see `scan_launch_config`; benchmarks and tests only).
    """
    T, Dm, N = _check_selective_scan_args(u, delta, A, B, C, D, ssm_state, z, delta_bias)
    S = check_varlen_shapes(cu_seqlens, state_slots, has_initial_state)
    num_snapshots = check_snapshot_shapes(snapshot_seqs, snapshot_lens, snapshot_slots)
    y = torch.empty_like(u)
    if S == 0:
        return y
    cfg = scan_launch_config(S, Dm, N, u.device, config)
    if cfg["float_bc"]:
        B, C = B.float(), C.float()
    grid = (cdiv(Dm, cfg["block_d"]), S)
    _selective_scan_kernel[grid](
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        y,
        ssm_state,
        cu_seqlens,
        state_slots,
        as_int8(has_initial_state),
        snapshot_seqs,
        snapshot_lens,
        snapshot_slots,
        num_snapshots,
        Dm,
        N,
        *u.stride(),
        *delta.stride(),
        *A.stride(),
        *B.stride(),
        *C.stride(),
        *(z.stride() if z is not None else (0, 0)),
        *y.stride(),
        *ssm_state.stride(),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=delta_softplus,
        FAST_LOG=not interpret_mode(),
        HAS_SNAPSHOTS=num_snapshots > 0,
        BLOCK_SNAPSHOTS=_SNAPSHOT_BLOCK,
        BLOCK_T=cfg["block_t"],
        BLOCK_D=cfg["block_d"],
        BLOCK_N=next_pow2(N),
        N_INNER=cfg["n_inner"],
        num_warps=cfg["num_warps"],
    )
    return y
