"""Hopper (sm_90) SSD scan kernel in Gluon: one program per head walks all its chunks.

The same chunked math as `_ssd_chunk_scan_kernel` in ssd_scan.py (read the comment there
first), for bf16 inputs with a head dim of 64 and a state dim of 64 or 128, organised
the other way round: instead of one program per (chunk, head) chaining states through
memory, one program (8 warps) per head walks the chunk ids in order and carries the state
in registers. Each chunk's data is copied (cp.async) a chunk ahead of its use, so the
program's time goes to the dots and the element-wise work, not to memory round trips
(the design the Triton-language kernel's measurements pointed at, docs/kernels_notes.md,
fourth session). Per chunk:

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
    unit strides on the last dims, and 16-byte aligned rows for its 16-byte copies (row
    and head strides multiples of 16 elements, as Triton's launcher specialises them).
    Off unless SSMSERVE_SSD_GLUON=1: on the H200 this kernel is correct but still slower
    than the Triton-language one (1.73 against 1.53 ms at 32k tokens, Bamba-9B dims; 1.73
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
    copied = [x, B, C]
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0
               for t in copied)  # fmt: skip


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
def _chunk_scalars(c, H, head, CHUNK: gl.constexpr, BLOCK: gl.constexpr, chunk_start_ptr,
                   chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr, state_slots_ptr,
                   cum_buf_ptr):  # fmt: skip
    # Chunk c's first token, length, sequence, the sequence's first and last chunk ids + 1,
    # its state slot, and cum at the end of each of its 4 row blocks (the last: the
    # chunk's total decay).
    seq = gl.load(chunk_seq_ptr + c)
    cum_c = cum_buf_ptr + (c * H + head) * CHUNK + BLOCK - 1
    return (
        gl.load(chunk_start_ptr + c).to(gl.int64),
        gl.load(chunk_len_ptr + c),
        seq,
        gl.load(seq_first_chunk_ptr + seq),
        gl.load(seq_first_chunk_ptr + seq + 1),
        gl.load(state_slots_ptr + seq).to(gl.int64),
        gl.load(cum_c),
        gl.load(cum_c + BLOCK),
        gl.load(cum_c + 2 * BLOCK),
        gl.load(cum_c + 3 * BLOCK),
    )


@jit
def _scale_rows_to(dst, src, cum, dts, j, ref_j, BLOCK: gl.constexpr, layout: gl.constexpr):
    # dst = x rows of row block j times exp(ref_j - cum_k) dt_k (ref_j = cum at the
    # block's last token, so the exponent is <= 0): the decays of the block's tokens up to
    # its end, carried by x instead of by the C.B^T or x^T operand.
    k = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    w = gl.exp2(ref_j - cum.slice(j * BLOCK, BLOCK).load(k.type.layout))
    w *= dts.slice(j * BLOCK, BLOCK).load(k.type.layout)
    rows = src.slice(j * BLOCK, BLOCK).load(layout).to(gl.float32)
    dst.slice(j * BLOCK, BLOCK).store((rows * w[:, None]).to(dst.dtype))


@jit
def _mma(a, b, acc):
    # acc + a @ b, waited for (one dot in flight at a time).
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc


@jit
def _mma_reg(a, b, acc):
    # The same with a in registers (kept alive until the dot is done).
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    return acc


@jit
def _exact_tile(acc, cb, cum, dts, x_c, p, j, cum_i, offs_r, offs_k, BLOCK: gl.constexpr):
    # acc += (C.B^T column tile j for pass p's rows, times the exact causal decay
    # exp(cum_i - cum_k) dt_k) x_j; -inf above the diagonal before the exp (the exponent
    # is positive there and may overflow).
    HALF: gl.constexpr = 2 * BLOCK
    cum_k = cum.slice(j * BLOCK, BLOCK).load(offs_k.type.layout)
    dt_k = dts.slice(j * BLOCK, BLOCK).load(offs_k.type.layout)
    causal = (p * HALF + offs_r)[:, None] >= (j * BLOCK + offs_k)[None, :]
    decay = gl.exp2(gl.where(causal, cum_i[:, None] - cum_k[None, :], -float("inf")))
    a = (cb.to(gl.float32) * decay * dt_k[None, :]).to(cb.dtype)
    return _mma_reg(a, x_c.slice(j * BLOCK, BLOCK), acc)


@jit
def _cb_rows(cb_ptr, cb_base, p, j, offs_r, offs_k, ROWS: gl.constexpr, BLOCK: gl.constexpr):
    # Rows of output pass p (row blocks 2p, 2p + 1) of the chunk's C.B^T, column tile j;
    # zeros for rows whose block is < j (that tile is above the diagonal, never written).
    m_row = 2 * p + offs_r // BLOCK
    ptrs = cb_ptr + cb_base + ((m_row * ROWS + j) * BLOCK + offs_r % BLOCK)[:, None] * BLOCK
    return gl.load(ptrs + offs_k[None, :], mask=(m_row >= j)[:, None], other=0.0)


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
    gl.static_assert(CHUNK == 4 * BLOCK, "written for 4 row blocks per chunk")
    gl.static_assert(gl.num_warps() == 8)
    ROWS: gl.constexpr = CHUNK // BLOCK
    HALF: gl.constexpr = CHUNK // 2  # rows of an x copy, and of an output pass
    dtype: gl.constexpr = x_desc.dtype
    # Phase 1: [P, N] state accumulator, N split over the two warp groups. Phase 2:
    # [HALF, P] outputs, one 64-row block per warp group.
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, N // 2, 16]
    )
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, P, 16]
    )
    a_y: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2)
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])  # x rows
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P, N], dtype)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    # x of the chunk, x with its decays (xw), B, C; S_in; cum/dt of this chunk and the next.
    x_smem = gl.allocate_shared_memory(dtype, [CHUNK, P], x_desc.layout)
    xw_smem = gl.allocate_shared_memory(dtype, [CHUNK, P], x_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [CHUNK, N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [CHUNK, N], c_desc.layout)
    s_smem = gl.allocate_shared_memory(dtype, [P, N], s_sl)
    vec_smem = gl.allocate_shared_memory(gl.float32, [4, CHUNK], vec_sl)  # cum, dt x 2
    # TMA barriers: x rows 0-127, x rows 128-255, B, C; each completes once per chunk.
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
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
    _tma_copy(x_desc, t0_first, x_col, bars.index(0), x_smem.slice(0, HALF))
    _tma_copy(x_desc, t0_first + HALF, x_col, bars.index(1), x_smem.slice(HALF, HALF))
    _tma_copy(b_desc, t0_first, bc_col, bars.index(2), b_smem)
    _tma_copy(c_desc, t0_first, bc_col, bars.index(3), c_smem)
    _copy_chunk_vectors(vec_smem.index(0), vec_smem.index(1), cum_buf_ptr, dt_buf_ptr,
                        head * CHUNK, CHUNK)  # fmt: skip
    async_copy.commit_group()

    offs_ps = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
    offs_ns = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
    offs_ra = gl.arange(0, HALF, layout=gl.SliceLayout(1, a_y))
    offs_kb = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, a_y))
    offs_ry = gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_y))
    offs_py = gl.arange(0, P, layout=gl.SliceLayout(0, mma_y))
    state = gl.zeros([P, N], gl.float32, mma_s)
    # Scalars of the current chunk; each iteration loads its successor's.
    t0, length, seq, first, last, slot, ref0, ref1, ref2, total = _chunk_scalars(
        0, H, head, CHUNK, BLOCK, chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr,
        seq_first_chunk_ptr, state_slots_ptr, cum_buf_ptr,
    )  # fmt: skip
    for c in range(0, num_chunks):
        buf = c % 2
        phase = c % 2
        c_next = gl.minimum(c + 1, num_chunks - 1)  # past the last: a harmless repeat
        t0_n, len_n, seq_n, first_n, last_n, slot_n, ref0_n, ref1_n, ref2_n, total_n = (
            _chunk_scalars(c_next, H, head, CHUNK, BLOCK, chunk_start_ptr, chunk_len_ptr,
                           chunk_seq_ptr, seq_first_chunk_ptr, state_slots_ptr, cum_buf_ptr)
        )  # fmt: skip
        row_n = t0_n.to(gl.int32)
        # Every warp is done with the previous chunk's cum/dt (buffer 1 - buf).
        gl.thread_barrier()
        _copy_chunk_vectors(vec_smem.index(2 - 2 * buf), vec_smem.index(3 - 2 * buf),
                            cum_buf_ptr, dt_buf_ptr, (c_next * H + head) * CHUNK, CHUNK)  # fmt: skip
        async_copy.commit_group()
        cum = vec_smem.index(2 * buf)
        dts = vec_smem.index(2 * buf + 1)
        cb_base = (c * (H // heads_per_group) + group) * (ROWS * ROWS * BLOCK * BLOCK)
        if c == first:
            has_init = gl.load(has_init_ptr + seq) != 0
            state = gl.load(
                state_ptr + slot * stride_s_slot + head * stride_s_h
                + offs_ps[:, None] * stride_s_p + offs_ns[None, :],
                mask=(offs_ps < P)[:, None] & has_init, other=0.0,
            ).to(gl.float32)  # fmt: skip
        s_smem.store(state.to(dtype))  # S_in, the B operand of phase 2's C.S dots
        async_copy.wait_group(1)  # this chunk's cum/dt (this thread's part) ...
        gl.thread_barrier()  # ... and every thread's

        # 1. x with its decays to each row block's end (xw), then
        #    S_out = exp(total) S_in + sum_j exp(total - ref_j) xw_j^T B_j, by Horner:
        #    acc = exp(ref_0) S_in + xw_0^T B_0, then acc = exp(ref_j - ref_{j-1}) acc +
        #    xw_j^T B_j; ref_3 = total.
        mbarrier.wait(bars.index(0), phase)  # x rows 0-127
        _scale_rows_to(xw_smem, x_smem, cum, dts, 0, ref0, BLOCK, rows_l)
        _scale_rows_to(xw_smem, x_smem, cum, dts, 1, ref1, BLOCK, rows_l)
        mbarrier.wait(bars.index(1), phase)  # x rows 128-255
        _scale_rows_to(xw_smem, x_smem, cum, dts, 2, ref2, BLOCK, rows_l)
        _scale_rows_to(xw_smem, x_smem, cum, dts, 3, total, BLOCK, rows_l)
        fence_async_shared()  # xw and s_smem (generic stores) before the wgmmas
        gl.thread_barrier()
        mbarrier.wait(bars.index(2), phase)  # B
        acc_s = state * gl.exp2(ref0)
        acc_s = _mma(xw_smem.slice(0, BLOCK).permute((1, 0)), b_smem.slice(0, BLOCK), acc_s)
        acc_s = acc_s * gl.exp2(ref1 - ref0)
        acc_s = _mma(xw_smem.slice(BLOCK, BLOCK).permute((1, 0)), b_smem.slice(BLOCK, BLOCK),
                     acc_s)  # fmt: skip
        acc_s = acc_s * gl.exp2(ref2 - ref1)
        acc_s = _mma(xw_smem.slice(2 * BLOCK, BLOCK).permute((1, 0)),
                     b_smem.slice(2 * BLOCK, BLOCK), acc_s)  # fmt: skip
        acc_s = acc_s * gl.exp2(total - ref2)
        acc_s = _mma(xw_smem.slice(3 * BLOCK, BLOCK).permute((1, 0)),
                     b_smem.slice(3 * BLOCK, BLOCK), acc_s)  # fmt: skip
        state = acc_s
        if c + 1 == last:
            gl.store(
                state_ptr + slot * stride_s_slot + head * stride_s_h
                + offs_ps[:, None] * stride_s_p + offs_ns[None, :],
                state.to(state_ptr.dtype.element_ty),
            )  # fmt: skip
        gl.thread_barrier()  # B is done with: the next chunk's comes
        _tma_copy(b_desc, row_n, bc_col, bars.index(2), b_smem)

        # 2. Outputs, HALF rows per pass (row blocks 2p, 2p + 1): exp(cum_i) C_i S_in, the
        #    pass's own [HALF, HALF] C.B^T tile with exact decays times x, and for the
        #    second pass the earlier tiles times xw, by Horner as in phase 1.
        mbarrier.wait(bars.index(3), phase)  # C
        zeros = gl.zeros([HALF, P], gl.float32, mma_y)
        for p in gl.static_range(2):
            acc = _mma(c_smem.slice(p * HALF, HALF), s_smem.permute((1, 0)), zeros)
            cum_y = cum.slice(p * HALF, HALF).load(gl.SliceLayout(1, mma_y))
            if p == 0:
                acc = acc * gl.exp2(cum_y)[:, None]
            else:
                cb_0 = _cb_rows(cb_ptr, cb_base, 1, 0, offs_ra, offs_kb, ROWS, BLOCK)
                cb_1 = _cb_rows(cb_ptr, cb_base, 1, 1, offs_ra, offs_kb, ROWS, BLOCK)
                acc = acc * gl.exp2(ref0)
                acc = _mma_reg(cb_0, xw_smem.slice(0, BLOCK), acc)
                acc = acc * gl.exp2(ref1 - ref0)
                acc = _mma_reg(cb_1, xw_smem.slice(BLOCK, BLOCK), acc)
                acc = acc * gl.exp2(cum_y - ref1)[:, None]
            # The pass's own tiles (its two row blocks' columns), exact decays.
            cum_i = cum.slice(p * HALF, HALF).load(gl.SliceLayout(1, a_y))
            cb_d = _cb_rows(cb_ptr, cb_base, p, 2 * p, offs_ra, offs_kb, ROWS, BLOCK)
            acc = _exact_tile(acc, cb_d, cum, dts, x_smem, p, 2 * p, cum_i, offs_ra, offs_kb, BLOCK)
            cb_d = _cb_rows(cb_ptr, cb_base, p, 2 * p + 1, offs_ra, offs_kb, ROWS, BLOCK)
            acc = _exact_tile(acc, cb_d, cum, dts, x_smem, p, 2 * p + 1, cum_i, offs_ra, offs_kb,
                              BLOCK)  # fmt: skip
            rows_y = p * HALF + offs_ry
            mask_y = (rows_y < length)[:, None] & (offs_py < P)[None, :]
            if HAS_D:
                x_rows = x_smem.slice(p * HALF, HALF).load(mma_y).to(gl.float32)
                acc += gl.load(D_ptr + head).to(gl.float32) * x_rows
            if p == 1:
                gl.thread_barrier()  # C and x are done with: the next chunk's come
                _tma_copy(c_desc, row_n, bc_col, bars.index(3), c_smem)
                _tma_copy(x_desc, row_n + HALF, x_col, bars.index(1), x_smem.slice(HALF, HALF))
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
            if p == 0:
                gl.thread_barrier()  # x rows 0-127 are done with (xw holds what phase 2 needs)
                _tma_copy(x_desc, row_n, x_col, bars.index(0), x_smem.slice(0, HALF))
        t0, length, seq, first, last, slot, ref0, ref1, ref2, total = (
            t0_n, len_n, seq_n, first_n, last_n, slot_n, ref0_n, ref1_n, ref2_n, total_n
        )  # fmt: skip
    # No copy may land after the program exits: the last iteration's, for a chunk past
    # the last, are waited for.
    async_copy.wait_group(0)
    for i in gl.static_range(4):
        mbarrier.wait(bars.index(i), num_chunks % 2)
    for i in gl.static_range(4):
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
    x_desc = TensorDescriptor(x, [T, H * P], [x.stride(0), 1], [CHUNK // 2, P],
                              gl.NVMMASharedLayout.get_default_for([CHUNK // 2, P], bf16))  # fmt: skip
    bc_layout = gl.NVMMASharedLayout.get_default_for([CHUNK, N], bf16)
    b_desc = TensorDescriptor(B, [T, G * N], [B.stride(0), 1], [CHUNK, N], bc_layout)
    c_desc = TensorDescriptor(C, [T, G * N], [C.stride(0), 1], [CHUNK, N], bc_layout)
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
