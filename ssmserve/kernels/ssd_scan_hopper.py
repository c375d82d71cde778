"""Hopper (sm_90) SSD scan kernel in Gluon: one program per head walks all its chunks.

The same chunked math as `_ssd_chunk_scan_kernel` in ssd_scan.py (read the comment there
first), for bf16 inputs with a head dim of 64 and a state dim of 64 or 128, organised
the other way round: instead of one program per (chunk, head) chaining states through
memory, one program (8 warps) per head walks the chunk ids in order and carries the state
in registers. Each chunk's x, B and C come by TMA (cum and dt by cp.async) a chunk ahead
of their use, so the program's time goes to the dots and the element-wise work, not to
memory round trips (docs/kernels_notes.md, fourth session, has the measurements). Per
chunk:

1. S_out = exp(sum dA) S_in + sum_t (exp(total - cum_t) dt_t x_t^T) B_t: two wgmmas with
   x^T weighted in registers, B from shared memory, the accumulator starting at the
   decayed S_in;
2. outputs 128 rows at a time (two 64-row blocks, one per warp group): exp(cum_i) C_i S_in
   from shared memory, plus the C.B^T tiles of the rows' blocks times decay-scaled x.

The state enters each chunk from the slot (a sequence's first chunk) or from registers,
and is written to the slot after a sequence's last chunk.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ssmserve.kernels._common import HAS_TRITON, interpret_mode

HAS_GLUON = HAS_TRITON and importlib.util.find_spec("triton.experimental.gluon") is not None

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
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
        constexpr = object

    def jit(fn):
        return fn


CHUNK = 256
BLOCK = 64
NUM_WARPS = 8


def hopper_scan_usable(
    x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor | None,
    y: torch.Tensor, ssm_state: torch.Tensor, chunk: int,
) -> bool:  # fmt: skip
    """Whether the Gluon kernel takes this call (else the Triton-language kernel does).

    It needs an sm_90 GPU, bf16 x, head dim 64, state dim 64 or 128, 256-token chunks,
    unit strides on the last dims, heads contiguous in x, B and C (the TMA copies view
    them as [T, heads * dim]), and 16-byte aligned bases and strides.
    Off unless SSMSERVE_SSD_GLUON=1: on the H200 this kernel is correct but still slower
    than the Triton-language one (1.66 against 1.53 ms at 32k tokens, Bamba-9B dims; 1.65
    against 0.99 at Mamba2-2.7B's 80 heads, which leave 52 SMs idle). It is kept for the
    work that continues it: docs/kernels_notes.md, fourth session, says where its time
    goes.
    """
    if not HAS_GLUON or interpret_mode() or os.environ.get("SSMSERVE_SSD_GLUON", "0") != "1":
        return False
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    if x.dtype != torch.bfloat16 or chunk != CHUNK or x.shape[0] == 0:
        return False
    if x.shape[2] != 64 or B.shape[2] not in (64, 128):
        return False
    tensors = [x, B, C, y] + ([z] if z is not None else [])
    if any(t.stride(2) != 1 for t in tensors) or ssm_state.stride(3) != 1:
        return False
    if x.stride(1) != x.shape[2] or B.stride(1) != B.shape[2] or C.stride(1) != C.shape[2]:
        return False  # the TMA copies view x, B and C as [T, heads * dim]
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (x, B, C))


@jit
def _tma_copy(desc, row, col, bar, smem):
    # One TMA copy of desc's block at (row, col) into smem, signalling bar when it lands.
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem)


@jit
def _copy_chunk_vectors(cum_smem, dt_smem, cum_buf_ptr, dt_buf_ptr, base, CHUNK: gl.constexpr):
    # cum and dt of one (chunk, head).
    offs = gl.arange(0, CHUNK, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    async_copy.async_copy_global_to_shared(cum_smem, cum_buf_ptr + base + offs)
    async_copy.async_copy_global_to_shared(dt_smem, dt_buf_ptr + base + offs)


@jit
def _chunk_scalars(c, H, head, CHUNK: gl.constexpr, chunk_start_ptr, chunk_len_ptr,
                   chunk_seq_ptr, seq_first_chunk_ptr, state_slots_ptr, cum_buf_ptr):  # fmt: skip
    # Chunk c's first token, length, sequence, the sequence's first and last chunk ids + 1,
    # its state slot, and the chunk's total decay (cum at its last position).
    seq = gl.load(chunk_seq_ptr + c)
    return (
        gl.load(chunk_start_ptr + c).to(gl.int64),
        gl.load(chunk_len_ptr + c),
        seq,
        gl.load(seq_first_chunk_ptr + seq),
        gl.load(seq_first_chunk_ptr + seq + 1),
        gl.load(state_slots_ptr + seq).to(gl.int64),
        gl.load(cum_buf_ptr + (c * H + head) * CHUNK + CHUNK - 1),
    )


@jit
def _cb_rows(cb_ptr, cb_base, p, j, offs_r, offs_k, ROWS: gl.constexpr, BLOCK: gl.constexpr):
    # Rows of output pass p (row blocks 2p, 2p + 1) of the chunk's C.B^T, column tile j;
    # zeros for rows whose block is < j (that tile is above the diagonal, never written).
    m_row = 2 * p + offs_r // BLOCK
    ptrs = cb_ptr + cb_base + ((m_row * ROWS + j) * BLOCK + offs_r % BLOCK)[:, None] * BLOCK
    return gl.load(ptrs + offs_k[None, :], mask=(m_row >= j)[:, None], other=0.0)


@jit
def _intra_tile(acc, cb, cum, dts, x_c, p, j, cum_i, offs_r, offs_k, BLOCK: gl.constexpr):
    # acc += (C.B^T tile j of pass p, times exp(cum_i - cum_k) dt_k, causal) x_j.
    HALF: gl.constexpr = 2 * BLOCK
    cum_k = cum.slice(j * BLOCK, BLOCK).load(offs_k.type.layout)
    dt_k = dts.slice(j * BLOCK, BLOCK).load(offs_k.type.layout)
    causal = (p * HALF + offs_r)[:, None] >= (j * BLOCK + offs_k)[None, :]
    decay = gl.exp2(gl.where(causal, cum_i[:, None] - cum_k[None, :], -float("inf")))
    a = (cb.to(gl.float32) * decay * dt_k[None, :]).to(cb.dtype)
    acc = warpgroup_mma(a, x_c.slice(j * BLOCK, BLOCK), acc, is_async=True)
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    return acc


@jit
def _ssd_scan_hopper_kernel(
    x_desc, b_desc, c_desc, z_ptr, D_ptr, y_ptr, cb_ptr, dt_buf_ptr, cum_buf_ptr,
    chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr, num_seqs,
    state_slots_ptr, has_init_ptr, state_ptr,
    T, H, heads_per_group,
    stride_z_t, stride_z_h, stride_y_t, stride_y_h,
    stride_s_slot, stride_s_h, stride_s_p,
    HAS_D: gl.constexpr, HAS_Z: gl.constexpr,
    CHUNK: gl.constexpr, BLOCK: gl.constexpr, P: gl.constexpr, N: gl.constexpr,
):  # fmt: skip
    gl.static_assert(CHUNK == 4 * BLOCK, "the copy schedule below is written for 4 row blocks")
    gl.static_assert(gl.num_warps() == 8)
    gl.static_assert(x_desc.block_type.shape[0] == CHUNK)
    ROWS: gl.constexpr = CHUNK // BLOCK
    HALF: gl.constexpr = CHUNK // 2  # rows of a B or C tile, and of an output pass
    dtype: gl.constexpr = x_desc.dtype
    # Phase 1: [P, N] state accumulator, N split over the two warp groups (each holds the
    # whole x^T operand). Phase 2: [HALF, P] outputs, 64 rows per warp group.
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, N // 2, 16]
    )
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, P, 16]
    )
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
    a_y: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2)
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P, N], dtype)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    # x and cum/dt of this chunk and the next; B rows 0-127, 128-255, C the same (one slot
    # each: a tile's slot takes the next chunk's tile once its dot is done).
    x_smem = gl.allocate_shared_memory(dtype, [2, CHUNK, P], x_desc.layout)
    vec_smem = gl.allocate_shared_memory(gl.float32, [4, CHUNK], vec_sl)  # cum, dt x 2
    bc_smem = gl.allocate_shared_memory(dtype, [4, HALF, N], b_desc.layout)
    s_smem = gl.allocate_shared_memory(dtype, [P, N], s_sl)
    # Copies of x and of the B and C tiles come by TMA, each signalling its slot's barrier:
    # x buffers 0, 1, then B/C slots 0..3.
    bars = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(6):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    head = gl.program_id(0)
    group = head // heads_per_group
    num_chunks = gl.load(seq_first_chunk_ptr + num_seqs)
    x_col = head * P
    bc_col = group * N

    # Prologue: chunk 0's copies. Rows past a chunk's end are the next sequence's tokens
    # (or zeros past T): they only meet zero weights (dt = 0 past the end), zero C.B^T
    # columns, or outputs that are not stored.
    t0_first = gl.load(chunk_start_ptr).to(gl.int32)
    _tma_copy(x_desc, t0_first, x_col, bars.index(0), x_smem.index(0))
    _copy_chunk_vectors(vec_smem.index(0), vec_smem.index(1), cum_buf_ptr, dt_buf_ptr,
                        head * CHUNK, CHUNK)  # fmt: skip
    async_copy.commit_group()
    for i in gl.static_range(4):
        desc = b_desc if i < 2 else c_desc
        _tma_copy(desc, t0_first + (i % 2) * HALF, bc_col, bars.index(2 + i), bc_smem.index(i))

    offs_ps = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
    offs_ns = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
    offs_ra = gl.arange(0, HALF, layout=gl.SliceLayout(1, a_y))
    offs_ka = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, a_y))
    offs_ry = gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_y))
    offs_py = gl.arange(0, P, layout=gl.SliceLayout(0, mma_y))
    state = gl.zeros([P, N], gl.float32, mma_s)
    # Scalars of the current chunk; each iteration loads its successor's.
    t0, length, seq, first, last, slot, total = _chunk_scalars(
        0, H, head, CHUNK, chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr,
        state_slots_ptr, cum_buf_ptr,
    )  # fmt: skip
    for c in range(0, num_chunks):
        buf = c % 2
        # Every warp is done with the previous chunk's x and cum/dt (buffer 1 - buf).
        gl.thread_barrier()
        # The next chunk's copies go first.
        c_next = gl.minimum(c + 1, num_chunks - 1)  # past the last: a harmless repeat
        t0_next, len_next, seq_next, first_next, last_next, slot_next, total_next = (
            _chunk_scalars(c_next, H, head, CHUNK, chunk_start_ptr, chunk_len_ptr,
                           chunk_seq_ptr, seq_first_chunk_ptr, state_slots_ptr, cum_buf_ptr)
        )  # fmt: skip
        _tma_copy(x_desc, t0_next.to(gl.int32), x_col, bars.index(1 - buf), x_smem.index(1 - buf))
        base_next = (c_next * H + head) * CHUNK
        _copy_chunk_vectors(vec_smem.index(2 - 2 * buf), vec_smem.index(3 - 2 * buf),
                            cum_buf_ptr, dt_buf_ptr, base_next, CHUNK)  # fmt: skip
        async_copy.commit_group()
        cum = vec_smem.index(2 * buf)
        dts = vec_smem.index(2 * buf + 1)
        x_c = x_smem.index(buf)
        # This chunk's C.B^T tiles for the first output pass, loaded now for later.
        cb_base = (c * (H // heads_per_group) + group) * (ROWS * ROWS * BLOCK * BLOCK)
        cb_00 = _cb_rows(cb_ptr, cb_base, 0, 0, offs_ra, offs_ka, ROWS, BLOCK)
        cb_01 = _cb_rows(cb_ptr, cb_base, 0, 1, offs_ra, offs_ka, ROWS, BLOCK)
        state_ptrs = (state_ptr + slot * stride_s_slot + head * stride_s_h
                      + offs_ps[:, None] * stride_s_p + offs_ns[None, :])  # fmt: skip
        if c == first:
            has_init = gl.load(has_init_ptr + seq) != 0
            state = gl.load(state_ptrs, mask=(offs_ps < P)[:, None] & has_init, other=0.0)
            state = state.to(gl.float32)
        s_smem.store(state.to(dtype))  # S_in, the B operand of phase 2's C.S dots

        # 1. S_out = exp(total) S_in + the chunk's contribution.
        async_copy.wait_group(1)  # this chunk's cum/dt (this thread's part) ...
        gl.thread_barrier()  # ... and every thread's
        mbarrier.wait(bars.index(buf), (c // 2) % 2)  # x
        acc_s = state * gl.exp2(total)
        for k in gl.static_range(2):
            mbarrier.wait(bars.index(2 + k), c % 2)  # B rows k*128 .. k*128+127
            weights = gl.exp2(total - cum.slice(k * HALF, HALF).load(gl.SliceLayout(0, a_s)))
            weights *= dts.slice(k * HALF, HALF).load(gl.SliceLayout(0, a_s))
            xT = x_c.slice(k * HALF, HALF).permute((1, 0)).load(a_s)
            a = (xT.to(gl.float32) * weights[None, :]).to(dtype)
            acc_s = warpgroup_mma(a, bc_smem.index(k), acc_s, is_async=True)
            acc_s, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, a))
            # This B tile's slot takes the next chunk's.
            gl.thread_barrier()
            _tma_copy(b_desc, t0_next.to(gl.int32) + k * HALF, bc_col, bars.index(2 + k),
                      bc_smem.index(k))  # fmt: skip
        state = acc_s
        if c + 1 == last:
            gl.store(state_ptrs, state.to(state_ptr.dtype.element_ty))
        fence_async_shared()  # s_smem (generic stores) before the C.S wgmmas
        gl.thread_barrier()

        # 2. Outputs, HALF rows per pass: row blocks 2p (warp group 0) and 2p + 1, each
        #    pass's C.B^T tiles loaded a phase ahead of their dots.
        cb_10 = _cb_rows(cb_ptr, cb_base, 1, 0, offs_ra, offs_ka, ROWS, BLOCK)
        cb_11 = _cb_rows(cb_ptr, cb_base, 1, 1, offs_ra, offs_ka, ROWS, BLOCK)
        for p in gl.static_range(2):
            if p == 1:
                cb_12 = _cb_rows(cb_ptr, cb_base, 1, 2, offs_ra, offs_ka, ROWS, BLOCK)
                cb_13 = _cb_rows(cb_ptr, cb_base, 1, 3, offs_ra, offs_ka, ROWS, BLOCK)
            mbarrier.wait(bars.index(4 + p), c % 2)  # C rows of this pass
            acc = warpgroup_mma(bc_smem.index(2 + p), s_smem.permute((1, 0)),
                                gl.zeros([HALF, P], gl.float32, mma_y), use_acc=False,
                                is_async=True)  # fmt: skip
            cum_i = cum.slice(p * HALF, HALF).load(gl.SliceLayout(1, a_y))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            _tma_copy(c_desc, t0_next.to(gl.int32) + p * HALF, bc_col, bars.index(4 + p),
                      bc_smem.index(2 + p))  # fmt: skip
            cum_y = cum.slice(p * HALF, HALF).load(gl.SliceLayout(1, mma_y))
            acc = acc * gl.exp2(cum_y)[:, None]
            # Tiles j = 0..2p+1 of C.B^T for the pass's rows (rows whose block is < j
            # took zeros), with the exact causal decay.
            if p == 0:
                acc = _intra_tile(acc, cb_00, cum, dts, x_c, 0, 0, cum_i, offs_ra, offs_ka, BLOCK)
                acc = _intra_tile(acc, cb_01, cum, dts, x_c, 0, 1, cum_i, offs_ra, offs_ka, BLOCK)
            else:
                acc = _intra_tile(acc, cb_10, cum, dts, x_c, 1, 0, cum_i, offs_ra, offs_ka, BLOCK)
                acc = _intra_tile(acc, cb_11, cum, dts, x_c, 1, 1, cum_i, offs_ra, offs_ka, BLOCK)
                acc = _intra_tile(acc, cb_12, cum, dts, x_c, 1, 2, cum_i, offs_ra, offs_ka, BLOCK)
                acc = _intra_tile(acc, cb_13, cum, dts, x_c, 1, 3, cum_i, offs_ra, offs_ka, BLOCK)
            rows_y = p * HALF + offs_ry
            mask_y = (rows_y < length)[:, None] & (offs_py < P)[None, :]
            if HAS_D:
                x_rows = x_c.slice(p * HALF, HALF).load(mma_y).to(gl.float32)
                acc += gl.load(D_ptr + head).to(gl.float32) * x_rows
            if HAS_Z:
                zg = gl.load(
                    z_ptr + (t0 + rows_y)[:, None] * stride_z_t + head * stride_z_h
                    + offs_py[None, :],
                    mask=mask_y, other=0.0,
                ).to(gl.float32)  # fmt: skip
                acc *= zg / (1.0 + gl.exp(-zg))
            gl.store(
                y_ptr + (t0 + rows_y)[:, None] * stride_y_t + head * stride_y_h
                + offs_py[None, :],
                acc.to(y_ptr.dtype.element_ty), mask=mask_y,
            )  # fmt: skip
        t0, length, seq, first, last, slot, total = (
            t0_next, len_next, seq_next, first_next, last_next, slot_next, total_next
        )  # fmt: skip
    # No copy may land after the program exits: the last iteration's, for a chunk past
    # the last, are waited for.
    async_copy.wait_group(0)
    mbarrier.wait(bars.index(num_chunks % 2), (num_chunks // 2) % 2)
    for i in gl.static_range(4):
        mbarrier.wait(bars.index(2 + i), num_chunks % 2)
    for i in gl.static_range(6):
        mbarrier.invalidate(bars.index(i))


def launch_hopper_scan(
    x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor | None,
    D: torch.Tensor | None, y: torch.Tensor, cb: torch.Tensor, layout: dict[str, torch.Tensor],
    ssm_state: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
) -> None:  # fmt: skip
    """Launch the kernel (after ssd_scan.py's cumsum and C.B^T launches): one program per
    head. `layout` is ssd_scan._chunk_layout's."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    bf16 = gl.bfloat16
    # 2-D views [T, heads * dim] (hopper_scan_usable checked the heads are contiguous).
    x_desc = TensorDescriptor(x, [T, H * P], [x.stride(0), 1], [CHUNK, P],
                              gl.NVMMASharedLayout.get_default_for([CHUNK, P], bf16))  # fmt: skip
    bc_layout = gl.NVMMASharedLayout.get_default_for([CHUNK // 2, N], bf16)
    b_desc = TensorDescriptor(B, [T, G * N], [B.stride(0), 1], [CHUNK // 2, N], bc_layout)
    c_desc = TensorDescriptor(C, [T, G * N], [C.stride(0), 1], [CHUNK // 2, N], bc_layout)
    z_strides = z.stride()[:2] if z is not None else (0, 0)
    _ssd_scan_hopper_kernel[(H,)](
        x_desc, b_desc, c_desc, z, D, y, cb, layout["dt"], layout["cum"],
        layout["chunk_start"], layout["chunk_len"], layout["chunk_seq"],
        layout["seq_first_chunk"], state_slots.shape[0],
        state_slots, has_initial_state.to(torch.int8), ssm_state,
        T, H, H // G,
        *z_strides, y.stride(0), y.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HAS_D=D is not None, HAS_Z=z is not None, CHUNK=CHUNK, BLOCK=BLOCK, P=P, N=N,
        num_warps=NUM_WARPS,
    )  # fmt: skip
