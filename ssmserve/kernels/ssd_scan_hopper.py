"""Hopper (sm_90) SSD scan kernel in Gluon: one CTA per head walks 64-token blocks.

The same chunked math as `_ssd_chunk_scan_kernel` in ssd_scan.py, organised for the H200:
one CTA per head walks its chunks' 64-token blocks in order and carries the state from
block to block, so each block's outputs need only the state entering the block (a bf16
snapshot in shared memory) and the block's own diagonal C.B^T tile (a wgmma from the C
and B already in shared memory). No off-diagonal C.B^T tiles, no separate C.B^T launch,
no state ring in global memory and no CTA-wide barriers. For block m of a chunk (cum is
the chunk-local cumsum of dt A in log2 units, ref = cum before the block, end = cum at
its last position; every exponent is <= 0):

    S_{m+1} = exp2(end - ref) S_m + sum_k exp2(end - cum_k) dt_k x_k^T B_k
    y_i     = exp2(cum_i - ref) C_i S_m
              + sum_{k <= i in the block} (C_i.B_k) exp2(cum_i - cum_k) dt_k x_k + D x_i

Partitions (gl.warp_specialize), synchronised by mbarriers only:
- loader (1 warp): TMA copies of each block's x, B, C, cum and dt into a ring of NS stages;
- state (the default partition, 4 warps): the recurrence, S in float32 registers; it
  hands S_m (bf16) to the output partition that owns block m through that partition's
  shared slot, and prepares block m + 1's operand while block m's dot runs;
- two output partitions (4 warps each): even and odd blocks, 64 rows each, each whole
  block sent to y by one TMA store from a shared tile.

Prefix-caching snapshots: the state partition also stores a chunk's end state into the
checkpoint row the metadata's "snapshot_row" gives that chunk (-1: none).

`ssd_scan_varlen_hopper` is the op of kernel_backend "hopper": the metadata launch of
ssd_scan.py, then this kernel where `hopper_scan_usable` says it takes the call, else the
Triton-language kernels. docs/kernels.md has the measurements.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from ssmserve.kernels._common import HAS_TRITON, as_int8, interpret_mode
from ssmserve.kernels.ssd_scan import _prepare, _scan_chunks, scan_launch_config

HAS_GLUON = HAS_TRITON and importlib.util.find_spec("triton.experimental.gluon") is not None

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    jit = gluon.jit
else:  # definitions only; hopper_scan_usable() is False and nothing launches

    class gl:  # noqa: N801 - stands in for the module
        constexpr = staticmethod(lambda v: v)

    def jit(fn=None, **options):
        return fn if fn is not None else (lambda f: f)


CHUNK_TOKENS = 256  # the chunking of ssd_scan.py's metadata this kernel reads
BLOCK_TOKENS = 64
NUM_STAGES = 3


def hopper_unavailable_reason(device: torch.device) -> str | None:
    """Why the Gluon kernel cannot run on `device` (kernel_backend "hopper"), or None."""
    return _unavailable_reason(device, interpret_mode())


@functools.cache  # asked at every launch: a device's answer does not change
def _unavailable_reason(device: torch.device, interpreting: bool) -> str | None:
    if not HAS_GLUON:
        return (
            "kernel backend 'hopper' needs Triton with Gluon (triton.experimental.gluon, "
            "Triton >= 3.6); use kernel_backend='triton'"
        )
    if interpreting:
        return (
            "kernel backend 'hopper' does not run in the Triton interpreter "
            "(TRITON_INTERPRET=1); use kernel_backend='triton'"
        )
    if device.type != "cuda":
        return (
            f"kernel backend 'hopper' needs an sm_90 CUDA GPU (H100/H200), not device "
            f"{device}; use kernel_backend='triton' or 'torch'"
        )
    if not torch.cuda.is_available():
        return "kernel backend 'hopper' needs an sm_90 CUDA GPU, and CUDA is not available"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return (
            f"kernel backend 'hopper' needs an sm_90 GPU (H100/H200); "
            f"{torch.cuda.get_device_name(device)} is sm_{capability[0]}{capability[1]}: "
            "use kernel_backend='triton'"
        )
    return None


def hopper_scan_usable(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    z: torch.Tensor | None,
    y: torch.Tensor,
    ssm_state: torch.Tensor,
    chunk: int,
) -> bool:
    """Whether the Gluon kernel takes this call (else the Triton-language kernel does).

    Per call, on a device where `hopper_unavailable_reason` is None: bf16 x, B and C, head
    dim 64, state dim 64 or 128, 256-token chunks, unit strides on the last dims, heads
    contiguous in x, B, C and y (the TMA copies view them as [T, heads * dim]), and
    16-byte aligned bases and strides.
    """
    if any(t.dtype != torch.bfloat16 for t in (x, B, C)) or chunk != CHUNK_TOKENS:
        return False
    if x.shape[0] == 0 or x.shape[2] != BLOCK_TOKENS or B.shape[2] not in (64, 128):
        return False
    tensors = [x, B, C, y] + ([z] if z is not None else [])
    if any(t.stride(2) != 1 for t in tensors) or ssm_state.stride(3) != 1:
        return False
    if any(t.stride(1) != t.shape[2] for t in (x, B, C, y)):
        return False  # the TMA copies view x, B, C and y as [T, heads * dim]
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 for t in (x, B, C, y))


# constexpr arguments through gl.warp_specialize reach the partitions as runtime
# values, so the sizes the partitions need are globals (P and N come from the shapes of
# the shared buffers).
CHUNK = gl.constexpr(CHUNK_TOKENS)
BLOCK = gl.constexpr(BLOCK_TOKENS)
NS = gl.constexpr(NUM_STAGES)
# mbarriers in one allocation: FULL[NS], EMPTY[NS], S_FULL[2], S_EMPTY[2].
FULL = gl.constexpr(0)
EMPTY = gl.constexpr(NUM_STAGES)
S_FULL = gl.constexpr(2 * NUM_STAGES)
S_EMPTY = gl.constexpr(2 * NUM_STAGES + 2)
NUM_BARS = gl.constexpr(2 * NUM_STAGES + 4)


@jit
def _loader(descs, bufs, bars, ptrs, scal):
    x_desc, b_desc, c_desc, cum_desc, dt_desc = descs
    x_s, b_s, c_s, cum_s, dt_s, s_s = bufs
    P: gl.constexpr = x_s.shape[2]
    N: gl.constexpr = b_s.shape[2]
    chunk_start_ptr, chunk_len_ptr = ptrs[0], ptrs[1]
    num_chunks, head, group, H = scal[0], scal[1], scal[2], scal[3]
    ROWS: gl.constexpr = CHUNK // BLOCK
    nbytes: gl.constexpr = (
        x_desc.block_type.nbytes
        + b_desc.block_type.nbytes
        + c_desc.block_type.nbytes
        + cum_desc.block_type.nbytes
        + dt_desc.block_type.nbytes
    )
    g = 0
    for c in range(0, num_chunks):
        t0 = gl.load(chunk_start_ptr + c)
        nb = (gl.load(chunk_len_ptr + c) + BLOCK - 1) // BLOCK
        for m in range(0, nb):
            s = g % NS
            mbarrier.wait(bars.index(EMPTY + s), ((g // NS) & 1) ^ 1)
            bar = bars.index(FULL + s)
            mbarrier.expect(bar, nbytes)
            row = t0 + m * BLOCK
            # Rows past the chunk's end are the next sequence's tokens (or zeros past
            # T): they meet zero dt, or outputs that are not stored.
            tma.async_copy_global_to_shared(x_desc, [row, head * P], bar, x_s.index(s))
            tma.async_copy_global_to_shared(b_desc, [row, group * N], bar, b_s.index(s))
            tma.async_copy_global_to_shared(c_desc, [row, group * N], bar, c_s.index(s))
            vec_at = ((c * H + head) * ROWS + m) * BLOCK
            tma.async_copy_global_to_shared(cum_desc, [vec_at], bar, cum_s.index(s))
            tma.async_copy_global_to_shared(dt_desc, [vec_at], bar, dt_s.index(s))
            g += 1


@jit
def _prep(x_s, cum_s, dt_s, s, a_s: gl.constexpr):
    # Block operand of the state update: x^T weighted by exp2(end - cum_k) dt_k, and end
    # (cum at the block's last position).
    dtype: gl.constexpr = x_s.dtype
    k_l: gl.constexpr = gl.SliceLayout(0, a_s)
    cum_v = cum_s.index(s)
    end = gl.max(cum_v.slice(BLOCK - 1, 1).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    weights = gl.exp2(end - cum_v.load(k_l)) * dt_s.index(s).load(k_l)
    xT = x_s.index(s).permute((1, 0)).load(a_s)
    return (xT.to(gl.float32) * weights[None, :]).to(dtype), end


@jit
def _state(descs, bufs, bars, ptrs, scal):
    x_s, b_s, c_s, cum_s, dt_s, s_s = bufs
    P: gl.constexpr = x_s.shape[2]
    N: gl.constexpr = b_s.shape[2]
    dtype: gl.constexpr = x_s.dtype
    chunk_len_ptr, chunk_seq_ptr = ptrs[1], ptrs[2]
    state_ptr, state_slots_ptr, has_init_ptr = ptrs[7], ptrs[8], ptrs[9]
    snapshot_row_ptr = ptrs[12]
    num_chunks, head = scal[0], scal[1]
    stride_s_slot, stride_s_h, stride_s_p = scal[4], scal[5], scal[6]
    has_snapshots = scal[12]
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
    )
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
    offs_p = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
    offs_n = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
    state = gl.zeros([P, N], gl.float32, mma_s)
    # The next chunk's scalars are loaded at the start of each chunk. A chunk starts a
    # sequence when its sequence differs from the previous chunk's, and ends it when the
    # next chunk's differs (or it is the last): slots and initial states are read only
    # at sequence boundaries.
    seq_prev = -1
    seq = gl.load(chunk_seq_ptr)
    nb = (gl.load(chunk_len_ptr) + BLOCK - 1) // BLOCK
    g = 0
    for c in range(0, num_chunks):
        c_next = gl.minimum(c + 1, num_chunks - 1)
        seq_next = gl.load(chunk_seq_ptr + c_next)
        nb_next = (gl.load(chunk_len_ptr + c_next) + BLOCK - 1) // BLOCK
        if seq != seq_prev:
            slot = gl.load(state_slots_ptr + seq).to(gl.int64)
            has_init = gl.load(has_init_ptr + seq) != 0
            state = gl.load(
                state_ptr
                + slot * stride_s_slot
                + head * stride_s_h
                + offs_p[:, None] * stride_s_p
                + offs_n[None, :],
                mask=(offs_p < P)[:, None] & has_init,
                other=0.0,
            )
            state = state.to(gl.float32)
        ref = 0.0
        # Block m's operand is prepared while block m - 1's dot runs.
        a, end = gl.zeros([P, BLOCK], dtype, a_s), 0.0
        if nb > 0:
            mbarrier.wait(bars.index(FULL + g % NS), (g // NS) & 1)
            a, end = _prep(x_s, cum_s, dt_s, g % NS, a_s)
        for m in range(0, nb):
            s = g % NS
            w = g % 2
            snap = state.to(dtype)  # S_m, for the outputs of this block
            # S_{m+1} = exp2(end - ref) S_m + a B_m.
            state = state * gl.exp2(end - ref)
            state = warpgroup_mma(a, b_s.index(s), state, is_async=True)
            ref = end
            # While it runs: hand S_m to the block's owner, and prepare block m + 1.
            mbarrier.wait(bars.index(S_EMPTY + w), ((g // 2) & 1) ^ 1)
            s_s.index(w).store(snap)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars.index(S_FULL + w), count=1)
            a_next, end_next = a, end
            if m + 1 < nb:
                mbarrier.wait(bars.index(FULL + (g + 1) % NS), ((g + 1) // NS) & 1)
                a_next, end_next = _prep(x_s, cum_s, dt_s, (g + 1) % NS, a_s)
            state, a = warpgroup_mma_wait(num_outstanding=0, deps=(state, a))
            # Generic-proxy reads of the stage are ordered before the TMA copies that
            # overwrite it: mbarrier.arrive alone does not order a shared load still in
            # flight before the loader's refill, which runs in the async proxy.
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(bars.index(EMPTY + s), count=1)
            a, end = a_next, end_next
            g += 1
        if has_snapshots != 0:
            snapshot_row = gl.load(snapshot_row_ptr + c).to(gl.int64)
            if snapshot_row >= 0:
                gl.store(
                    state_ptr
                    + snapshot_row * stride_s_slot
                    + head * stride_s_h
                    + offs_p[:, None] * stride_s_p
                    + offs_n[None, :],
                    state.to(state_ptr.dtype.element_ty),
                )
        if (seq_next != seq) | (c + 1 == num_chunks):
            slot = gl.load(state_slots_ptr + seq).to(gl.int64)
            gl.store(
                state_ptr
                + slot * stride_s_slot
                + head * stride_s_h
                + offs_p[:, None] * stride_s_p
                + offs_n[None, :],
                state.to(state_ptr.dtype.element_ty),
            )
        seq_prev, seq, nb = seq, seq_next, nb_next


@jit
def _outputs(descs, bufs, bars, ptrs, scal, W: gl.constexpr):
    x_s, b_s, c_s, cum_s, dt_s, s_s = bufs
    P: gl.constexpr = x_s.shape[2]
    dtype: gl.constexpr = x_s.dtype
    chunk_start_ptr, chunk_len_ptr = ptrs[0], ptrs[1]
    cum_buf_ptr, D_ptr, y_ptr, z_ptr = ptrs[3], ptrs[4], ptrs[5], ptrs[6]
    y_desc, y_s = ptrs[10], ptrs[11]
    num_chunks, head, H = scal[0], scal[1], scal[3]
    stride_y_t, stride_y_h, has_z, stride_z_t, stride_z_h = (
        scal[7],
        scal[8],
        scal[9],
        scal[10],
        scal[11],
    )
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
    )
    a_y: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2)
    # The diagonal tile C_m B_m^T [BLOCK, BLOCK] by wgmma from the stage's C and B is in
    # the outputs' layout (P == BLOCK): one zero tile serves both dots, and the columns
    # index both the tile's keys and the outputs' head dim.
    gl.static_assert(P == BLOCK)
    offs_r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_y))
    offs_c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma_y))
    d = gl.load(D_ptr + head).to(gl.float32)
    zeros = gl.zeros([BLOCK, P], gl.float32, mma_y)

    g = 0
    for c in range(0, num_chunks):
        t0 = gl.load(chunk_start_ptr + c).to(gl.int64)
        length = gl.load(chunk_len_ptr + c)
        nb = (length + BLOCK - 1) // BLOCK
        cum_base = cum_buf_ptr + (c * H + head) * CHUNK
        for m in range(0, nb):
            if g % 2 == W:
                s = g % NS
                ref = gl.load(cum_base + m * BLOCK - 1, mask=m > 0, other=0.0)
                mbarrier.wait(bars.index(FULL + s), (g // NS) & 1)
                mbarrier.wait(bars.index(S_FULL + W), (g // 2) & 1)
                cb = warpgroup_mma(
                    c_s.index(s), b_s.index(s).permute((1, 0)), zeros, use_acc=False, is_async=True
                )
                acc = warpgroup_mma(
                    c_s.index(s), s_s.index(W).permute((1, 0)), zeros, use_acc=False, is_async=True
                )
                # The diagonal tile's operand while the C.S dot runs.
                cum_v = cum_s.index(s)
                cum_i = cum_v.load(gl.SliceLayout(1, mma_y))
                cum_k = cum_v.load(gl.SliceLayout(0, mma_y))
                dt_k = dt_s.index(s).load(gl.SliceLayout(0, mma_y))
                causal = offs_r[:, None] >= offs_c[None, :]
                decay = gl.exp2(gl.where(causal, cum_i[:, None] - cum_k[None, :], -float("inf")))
                decay *= dt_k[None, :]
                cb = warpgroup_mma_wait(num_outstanding=1, deps=(cb,))
                # D x rides on the tile's diagonal (the operand is bf16 either way).
                cbd = cb * decay
                cbd = gl.where(offs_r[:, None] == offs_c[None, :], cbd + d, cbd)
                a = gl.convert_layout(cbd.to(dtype), a_y)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()
                mbarrier.arrive(bars.index(S_EMPTY + W), count=1)
                acc = acc * gl.exp2(cum_i - ref)[:, None]
                acc = warpgroup_mma(a, x_s.index(s), acc, is_async=True)
                acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
                fence_async_shared()  # see _state
                gl.thread_barrier()
                mbarrier.arrive(bars.index(EMPTY + s), count=1)
                rows = t0 + m * BLOCK + offs_r
                mask = ((m * BLOCK + offs_r) < length)[:, None] & (offs_c < P)[None, :]
                if has_z != 0:
                    zg = gl.load(
                        z_ptr + rows[:, None] * stride_z_t + head * stride_z_h + offs_c[None, :],
                        mask=mask,
                        other=0.0,
                    ).to(gl.float32)
                    acc *= zg / (1.0 + gl.exp(-zg))
                if (m + 1) * BLOCK <= length:
                    tma.store_wait(0)
                    gl.thread_barrier()
                    y_s.index(W).store(acc.to(dtype))
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(
                        y_desc, [(t0 + m * BLOCK).to(gl.int32), head * P], y_s.index(W)
                    )
                else:
                    gl.store(
                        y_ptr + rows[:, None] * stride_y_t + head * stride_y_h + offs_c[None, :],
                        acc.to(y_ptr.dtype.element_ty),
                        mask=mask,
                    )
            g += 1
    tma.store_wait(0)


@jit
def _outputs_even(descs, bufs, bars, ptrs, scal):
    _outputs(descs, bufs, bars, ptrs, scal, 0)


@jit
def _outputs_odd(descs, bufs, bars, ptrs, scal):
    _outputs(descs, bufs, bars, ptrs, scal, 1)


# Counts and index arrays that follow the batch are not specialised: one compiled kernel
# for every batch (the descriptors' keys hold only their block shapes and layouts).
@jit(
    do_not_specialize=(
        "chunk_start_ptr",
        "chunk_len_ptr",
        "chunk_seq_ptr",
        "seq_first_chunk_ptr",
        "num_seqs",
        "state_slots_ptr",
        "has_init_ptr",
        "snapshot_row_ptr",
    )
)
def _ssd_scan_hopper_kernel(
    x_desc,
    b_desc,
    c_desc,
    cum_desc,
    dt_desc,
    y_desc,
    z_ptr,
    D_ptr,
    y_ptr,
    cum_buf_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    chunk_seq_ptr,
    seq_first_chunk_ptr,
    num_seqs,
    state_slots_ptr,
    has_init_ptr,
    state_ptr,
    snapshot_row_ptr,
    H,
    G,
    has_z,
    has_snapshots,
    stride_z_t,
    stride_z_h,
    stride_y_t,
    stride_y_h,
    stride_s_slot,
    stride_s_h,
    stride_s_p,
    P: gl.constexpr,
    N: gl.constexpr,
):
    dtype: gl.constexpr = x_desc.dtype
    x_s = gl.allocate_shared_memory(dtype, [NS, BLOCK, P], x_desc.layout)
    b_s = gl.allocate_shared_memory(dtype, [NS, BLOCK, N], b_desc.layout)
    c_s = gl.allocate_shared_memory(dtype, [NS, BLOCK, N], c_desc.layout)
    cum_s = gl.allocate_shared_memory(gl.float32, [NS, BLOCK], cum_desc.layout)
    dt_s = gl.allocate_shared_memory(gl.float32, [NS, BLOCK], dt_desc.layout)
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P, N], dtype)
    s_s = gl.allocate_shared_memory(dtype, [2, P, N], s_sl)
    y_s = gl.allocate_shared_memory(dtype, [2, BLOCK, P], y_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(FULL + i), count=1)
        mbarrier.init(bars.index(EMPTY + i), count=2)  # the state and one output partition
    for i in gl.static_range(2):
        mbarrier.init(bars.index(S_FULL + i), count=1)
        mbarrier.init(bars.index(S_EMPTY + i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    head = gl.program_id(0)
    group = head // (H // G)
    num_chunks = gl.load(seq_first_chunk_ptr + num_seqs)
    descs = (x_desc, b_desc, c_desc, cum_desc, dt_desc)
    bufs = (x_s, b_s, c_s, cum_s, dt_s, s_s)
    ptrs = (
        chunk_start_ptr,
        chunk_len_ptr,
        chunk_seq_ptr,
        cum_buf_ptr,
        D_ptr,
        y_ptr,
        z_ptr,
        state_ptr,
        state_slots_ptr,
        has_init_ptr,
        y_desc,
        y_s,
        snapshot_row_ptr,
    )
    scal = (
        num_chunks,
        head,
        group,
        H,
        stride_s_slot,
        stride_s_h,
        stride_s_p,
        stride_y_t,
        stride_y_h,
        has_z,
        stride_z_t,
        stride_z_h,
        has_snapshots,
    )
    args = (descs, bufs, bars, ptrs, scal)
    gl.warp_specialize(
        [(_state, args), (_loader, args), (_outputs_even, args), (_outputs_odd, args)],
        [1, 4, 4],
        [24, 152, 152],
    )


@functools.cache
def _shared_layouts(P: int, N: int) -> tuple:
    """The kernel's shared-memory layouts of x and y blocks, B and C blocks, and the cum /
    dt vectors (made once: each costs host time at every launch otherwise)."""
    blk, bf16 = BLOCK_TOKENS, gl.bfloat16
    return (
        gl.NVMMASharedLayout.get_default_for([blk, P], bf16),
        gl.NVMMASharedLayout.get_default_for([blk, N], bf16),
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1),
    )


def launch_hopper_scan(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    z: torch.Tensor | None,
    D: torch.Tensor | None,
    y: torch.Tensor,
    layout: dict[str, torch.Tensor],
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> None:
    """Launch the kernel after ssd_scan.py's metadata launch (`layout` is
    ssd_scan._prepare's): one CTA per head."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    blk = BLOCK_TOKENS
    xy_layout, bc_layout, vec_layout = _shared_layouts(P, N)
    x_desc = TensorDescriptor(x, [T, H * P], [x.stride(0), 1], [blk, P], xy_layout)
    b_desc = TensorDescriptor(B, [T, G * N], [B.stride(0), 1], [blk, N], bc_layout)
    c_desc = TensorDescriptor(C, [T, G * N], [C.stride(0), 1], [blk, N], bc_layout)
    # cum and dt ([chunk ids, H, 256] float32) as flat vectors, one 64-entry box per block.
    cum1, dt1 = layout["cum"].view(-1), layout["dt"].view(-1)
    cum_desc = TensorDescriptor(cum1, [cum1.numel()], [1], [blk], vec_layout)
    dt_desc = TensorDescriptor(dt1, [dt1.numel()], [1], [blk], vec_layout)
    y_desc = TensorDescriptor(y, [T, H * P], [y.stride(0), 1], [blk, P], xy_layout)
    D = D if D is not None else torch.zeros(H, device=x.device)
    z_strides = z.stride()[:2] if z is not None else (0, 0)
    snapshot_row = layout.get("snapshot_row")
    _ssd_scan_hopper_kernel[(H,)](
        x_desc,
        b_desc,
        c_desc,
        cum_desc,
        dt_desc,
        y_desc,
        z if z is not None else y,
        D,
        y,
        layout["cum"],
        layout["chunk_start"],
        layout["chunk_len"],
        layout["chunk_seq"],
        layout["seq_first_chunk"],
        state_slots.shape[0],
        state_slots,
        as_int8(has_initial_state),
        ssm_state,
        snapshot_row if snapshot_row is not None else layout["chunk_seq"],
        H,
        G,
        int(z is not None),
        int(snapshot_row is not None),
        *z_strides,
        y.stride(0),
        y.stride(1),
        ssm_state.stride(0),
        ssm_state.stride(1),
        ssm_state.stride(2),
        P=P,
        N=N,
        num_warps=4,
    )


def ssd_scan_varlen_hopper(
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
    start_positions: torch.Tensor | None = None,
    snapshot_seqs: torch.Tensor | None = None,
    snapshot_lens: torch.Tensor | None = None,
    snapshot_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SSD scan of kernel_backend "hopper" (same arguments, shapes and result as
    ssd_scan.ssd_scan_varlen_ref; snapshots as in ssd_scan.ssd_scan_varlen_triton).

    After the chunk metadata launch, the Gluon kernel runs where `hopper_scan_usable` says
    it takes the call (bf16 inputs, head dim 64, state dim 64 or 128, 256-token chunks,
    the strides TMA needs); other calls run the Triton-language kernels with their default
    launch parameters, as ssd_scan_varlen_triton does. No host sync (CUDA-graph safe).
    Raises where the Gluon kernel cannot run at all (see `hopper_unavailable_reason`).
    """
    reason = hopper_unavailable_reason(x.device)
    if reason is not None:
        raise RuntimeError(reason)
    y, chunk, layout = _prepare(
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
        dt_softplus,
        dt_limit,
        z,
        chunk_size,
        start_positions,
        (snapshot_seqs, snapshot_lens, snapshot_slots),
    )
    if layout is None:
        return y
    if hopper_scan_usable(x, B, C, z, y, ssm_state, chunk):
        launch_hopper_scan(x, B, C, z, D, y, layout, ssm_state, state_slots, has_initial_state)
    else:
        cfg = scan_launch_config(x.dtype, chunk)
        _scan_chunks(
            x, B, C, z, D, y, layout, ssm_state, state_slots, has_initial_state, chunk, cfg
        )
    return y
