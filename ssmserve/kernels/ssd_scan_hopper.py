"""Hopper (sm_90) fast path of the SSD scan's fused kernel, in Gluon.

Same work and the same three phases as `_ssd_chunk_scan_kernel` in ssd_scan.py (read the
comment there first), for 16-bit bf16 inputs with a head dim of 64 and a state dim of 64
or 128. What Gluon adds over the Triton-language kernel is control of the data movement:

- the chunk's x (all of it, [CHUNK, P]) is copied once into shared memory with cp.async
  and serves both phases as the wgmma B operand, never passing through registers;
- the B tiles (phase 1) and then the C tiles (phase 3) stream through a three-slot ring of
  shared memory, each copy issued two tiles ahead of its use;
- the per-token decays are applied to the operand that lives in registers (x^T in phase
  1, the C.B^T tiles in phase 3), so each dot is one asynchronous wgmma with A in
  registers and B in shared memory, and the next operand is built while it runs.

One warp group per (chunk, head) program; programs take their (chunk, head) from the
same atomic ticket and chain their states through the same ring and flags as the
Triton-language kernel (the launcher in ssd_scan.py prepares both).
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
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    jit = gluon.jit
else:  # definitions only; hopper_scan_usable() is False and nothing launches

    class gl:  # noqa: N801 - stands in for the module
        constexpr = object

    def jit(fn):
        return fn


CHUNK = 256
BLOCK = 64
NUM_WARPS = 4


def hopper_scan_usable(
    x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor | None,
    y: torch.Tensor, ssm_state: torch.Tensor, chunk: int,
) -> bool:  # fmt: skip
    """Whether the Gluon kernel takes this call (else the Triton-language kernel does).

    It needs an sm_90 GPU, bf16 x, head dim 64, state dim 64 or 128, 256-token chunks,
    unit strides on the last dims, and 16-byte aligned rows for its 16-byte copies (row
    and head strides multiples of 16 elements, as Triton's launcher specialises them).
    Off unless SSMSERVE_SSD_GLUON=1: on the H200 this kernel is still slower than the
    Triton-language one (1.90 against 1.53 ms at 32k tokens, Bamba-9B dims; see
    docs/kernels_notes.md, fourth session), so it is kept for the work that continues it.
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
    copied = [x, B, C]
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0
               for t in copied)  # fmt: skip


@jit
def _rows(t0, rows, length, T):
    # Token index of chunk rows for the copies. Rows past the chunk's end repeat its last
    # token instead of being masked (a masked cp.async did not compile here): they only
    # meet zero weights (dt = 0 past the end, and zero C.B^T columns), and outputs of
    # those rows are not stored. The clamp to T - 1 covers an empty sequence's chunk.
    return gl.minimum(t0 + gl.minimum(rows, gl.maximum(length - 1, 0)), T - 1)


@jit
def _weighted_xT(x_tile, cumdt_smem, total, k, offs_k, layout):
    # Phase 1's dot operand: x^T of one row block times exp(total - cum_t) dt_t per token.
    ROWS: gl.constexpr = cumdt_smem.shape[0] // 2
    w = gl.exp2(total - cumdt_smem.index(k).load(offs_k.type.layout))
    w *= cumdt_smem.index(ROWS + k).load(offs_k.type.layout)
    xT = x_tile.permute((1, 0)).load(layout)
    return (xT.to(gl.float32) * w[None, :]).to(xT.dtype)


@jit
def _cb_tile(cb_ptr, cb_base, m, j, cb_tile, ROWS: gl.constexpr, BLOCK: gl.constexpr):
    # Tile (m, j) of the chunk's C.B^T, straight into the dot operand's registers.
    return gl.load(cb_ptr + cb_base + (m * ROWS + j) * (BLOCK * BLOCK) + cb_tile)


@jit
def _scores(cb, cumdt_smem, m, j, cum_r, ref, r, offs_r, offs_k, BLOCK: gl.constexpr):
    # Phase 3's dot operand for tile (m, j) of C.B^T, decays applied: j < m as
    # exp(cum_i - ref) exp(ref - cum_k) dt_k (ref = cum before the row block: both
    # exponents <= 0); the diagonal element-wise, -inf above it before the exp (the
    # exponent is positive there and may overflow).
    ROWS: gl.constexpr = cumdt_smem.shape[0] // 2
    cum_k = cumdt_smem.index(j).load(offs_k.type.layout)
    dt_k = cumdt_smem.index(ROWS + j).load(offs_k.type.layout)
    a = cb.to(gl.float32)
    if j < m:
        a = a * r[:, None] * (gl.exp2(ref - cum_k) * dt_k)[None, :]
    else:
        causal = offs_r[:, None] >= offs_k[None, :]
        a = a * gl.exp2(gl.where(causal, cum_r[:, None] - cum_k[None, :], -float("inf")))
        a = a * dt_k[None, :]
    return a.to(cb.dtype)


@jit
def _ssd_chunk_scan_hopper_kernel(
    x_ptr, B_ptr, C_ptr, z_ptr, D_ptr, y_ptr, cb_ptr, dt_buf_ptr, cum_buf_ptr,
    chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr,
    state_slots_ptr, has_init_ptr, state_ptr, ring_ptr, ticket_ptr, published_ptr,
    T, H, heads_per_group,
    stride_x_t, stride_x_h, stride_b_t, stride_b_g, stride_c_t, stride_c_g,
    stride_z_t, stride_z_h, stride_y_t, stride_y_h,
    stride_s_slot, stride_s_h, stride_s_p,
    HAS_D: gl.constexpr, HAS_Z: gl.constexpr,
    CHUNK: gl.constexpr, BLOCK: gl.constexpr, P: gl.constexpr, N: gl.constexpr,
):  # fmt: skip
    ROWS: gl.constexpr = CHUNK // BLOCK
    NBUF: gl.constexpr = 3  # slots of the B/C tile ring
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    # wgmma accumulators: the state contribution [P, N] and an output block [BLOCK, P].
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
    )
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
    )
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
    a_y: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2)
    # Copies and stores: 16 bytes per thread along the contiguous dim.
    ld: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1], order=[1, 0]
    )
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, P], dtype)
    bc_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, N], dtype)
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P, N], dtype)

    x_smem = gl.allocate_shared_memory(dtype, [ROWS, BLOCK, P], x_sl)
    bc_smem = gl.allocate_shared_memory(dtype, [NBUF, BLOCK, N], bc_sl)
    s_smem = gl.allocate_shared_memory(dtype, [P, N], s_sl)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    # cum of the chunk's row blocks in rows 0..ROWS-1, dt in rows ROWS..2 ROWS-1
    cumdt_smem = gl.allocate_shared_memory(gl.float32, [2 * ROWS, BLOCK], vec_sl)

    ticket = gl.atomic_add(ticket_ptr, 1)
    chunk = (ticket // H).to(gl.int64)
    head = ticket % H  # the chain (lane) of this program
    seq = gl.load(chunk_seq_ptr + chunk)
    if seq >= 0:
        group = head // heads_per_group
        length = gl.load(chunk_len_ptr + chunk)
        t0 = gl.load(chunk_start_ptr + chunk).to(gl.int64)
        base = (chunk * H + head) * CHUNK
        total = gl.load(cum_buf_ptr + base + CHUNK - 1)

        # Copies. Tile stream: B tiles 0..ROWS-1 (phase 1), then C tiles (phase 3); tile
        # i goes to slot i % NBUF, and is issued once tile i - 2's dot has completed, so
        # the one being used and the next are in flight or landed. Rows past the chunk's
        # end are zero-filled (masked copies), so partial chunks need no other masks on
        # the dot operands.
        offs_r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, ld))
        offs_pc = gl.arange(0, P, layout=gl.SliceLayout(0, ld))
        offs_nc = gl.arange(0, N, layout=gl.SliceLayout(0, ld))
        x_cols = x_ptr + head * stride_x_h + offs_pc[None, :]
        b_cols = B_ptr + group * stride_b_g + offs_nc[None, :]
        c_cols = C_ptr + group * stride_c_g + offs_nc[None, :]
        for k in gl.static_range(ROWS):
            async_copy.async_copy_global_to_shared(
                x_smem.index(k), x_cols + _rows(t0, k * BLOCK + offs_r, length, T)[:, None] * stride_x_t,
            )  # fmt: skip
        offs_blk = gl.arange(0, BLOCK, layout=gl.BlockedLayout([1], [32], [4], [0]))
        for k in gl.static_range(ROWS):
            async_copy.async_copy_global_to_shared(
                cumdt_smem.index(k), cum_buf_ptr + base + k * BLOCK + offs_blk
            )  # fmt: skip
            async_copy.async_copy_global_to_shared(
                cumdt_smem.index(ROWS + k), dt_buf_ptr + base + k * BLOCK + offs_blk
            )  # fmt: skip
        for i in gl.static_range(2):
            async_copy.async_copy_global_to_shared(
                bc_smem.index(i), b_cols + _rows(t0, i * BLOCK + offs_r, length, T)[:, None] * stride_b_t,
            )  # fmt: skip
            async_copy.commit_group()

        # 1. Contribution to the chunk's end state, [P, N]:
        #    sum_t (exp(total - cum_t) dt_t x_t^T) B_t, the weights on x^T (registers).
        #    One dot in flight at a time, and each iteration ends with it complete (an
        #    in-flight accumulator must not cross anything the compiler may copy it
        #    over); the next operand is built while the dot runs.
        offs_ks = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, a_s))
        acc_s = gl.zeros([P, N], gl.float32, mma_s)
        async_copy.wait_group(1)  # x and B tile 0 landed (this thread's copies)
        fence_async_shared()
        gl.thread_barrier()  # ... and every thread's
        a = _weighted_xT(x_smem.index(0), cumdt_smem, total, 0, offs_ks, a_s)
        for k in gl.static_range(ROWS):
            acc_s = warpgroup_mma(a, bc_smem.index(k % NBUF), acc_s, is_async=True)
            # Tile k - 1's dot completed last iteration: its slot takes tile k + 2.
            gl.thread_barrier()
            if k + 2 < ROWS:
                rows = _rows(t0, (k + 2) * BLOCK + offs_r, length, T)
                async_copy.async_copy_global_to_shared(
                    bc_smem.index((k + 2) % NBUF), b_cols + rows[:, None] * stride_b_t
                )  # fmt: skip
            else:
                rows = _rows(t0, (k + 2 - ROWS) * BLOCK + offs_r, length, T)
                async_copy.async_copy_global_to_shared(
                    bc_smem.index((k + 2) % NBUF), c_cols + rows[:, None] * stride_c_t
                )  # fmt: skip
            async_copy.commit_group()
            a_next = a
            if k + 1 < ROWS:
                async_copy.wait_group(1)  # tile k + 1 landed
                fence_async_shared()
                gl.thread_barrier()
                a_next = _weighted_xT(
                    x_smem.index(k + 1), cumdt_smem, total, k + 1, offs_ks, a_s
                )  # fmt: skip
            acc_s, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, a))
            a = a_next

        # 2. The chained step (as in the Triton-language kernel; states here are [P, N]).
        if chunk > 0:
            seen = gl.atomic_add(published_ptr + head, 0, sem="acquire")
            while seen < chunk:
                seen = gl.atomic_add(published_ptr + head, 0, sem="acquire")
        first = gl.load(seq_first_chunk_ptr + seq).to(gl.int64)
        last = gl.load(seq_first_chunk_ptr + seq + 1).to(gl.int64)
        offs_ps = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
        offs_ns = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
        state_tile = offs_ps[:, None] * N + offs_ns[None, :]
        ring_head = ring_ptr + head * (P * N)
        slot_head = state_ptr + gl.load(state_slots_ptr + seq).to(gl.int64) * stride_s_slot
        slot_head += head * stride_s_h
        if chunk == first:
            has_init = gl.load(has_init_ptr + seq) != 0
            state_in = gl.load(
                slot_head + offs_ps[:, None] * stride_s_p + offs_ns[None, :],
                mask=(offs_ps < P)[:, None] & has_init, other=0.0,
            ).to(gl.float32)  # fmt: skip
        else:
            state_in = gl.load(
                ring_head + ((chunk - 1) % 2) * (H * P * N) + state_tile, cache_modifier=".cg"
            )  # fmt: skip
        state_out = state_in * gl.exp2(total) + acc_s
        if chunk + 1 == last:
            gl.store(
                slot_head + offs_ps[:, None] * stride_s_p + offs_ns[None, :],
                state_out.to(state_ptr.dtype.element_ty),
            )  # fmt: skip
        else:
            gl.store(ring_head + (chunk % 2) * (H * P * N) + state_tile, state_out)
        gl.thread_barrier()
        gl.atomic_xchg(published_ptr + head, (chunk + 1).to(gl.int32), sem="release")
        s_smem.store(state_in.to(dtype))
        fence_async_shared()
        gl.thread_barrier()

        # 3. Outputs, BLOCK rows at a time: exp(cum_i) C_i S_in (C tile from the ring, S_in
        #    from shared memory), plus the diagonal C.B^T tile with the element-wise causal
        #    decay, plus each earlier tile j scaled as exp(cum_i - ref) * exp(ref - cum_j)
        #    dt_j (ref = cum at the row block's start - 1; both exponents <= 0), all in
        #    one accumulator; then D x, the gate, the store.
        offs_ra = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, a_y))
        offs_ka = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, a_y))
        cb_tile = offs_ra[:, None] * BLOCK + offs_ka[None, :]
        offs_ry = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_y))
        offs_py = gl.arange(0, P, layout=gl.SliceLayout(0, mma_y))
        cb_base = (chunk * (H // heads_per_group) + group) * (ROWS * ROWS * BLOCK * BLOCK)
        zeros_y = gl.zeros([BLOCK, P], gl.float32, mma_y)
        for m in range(0, gl.cdiv(length, BLOCK)):
            m0 = m * BLOCK
            async_copy.wait_group(1)  # C tile m (stream tile ROWS + m) landed
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(
                bc_smem.index((ROWS + m) % NBUF), s_smem.permute((1, 0)), zeros_y,
                use_acc=False, is_async=True,
            )  # fmt: skip
            # Tiles j = 0, 1 of the row are loaded now; tile j + 2 while dot j runs.
            cb_j = _cb_tile(cb_ptr, cb_base, m, 0, cb_tile, ROWS, BLOCK)
            cb_next = _cb_tile(cb_ptr, cb_base, m, gl.minimum(m, 1), cb_tile, ROWS, BLOCK)
            ref = gl.load(cum_buf_ptr + base + gl.maximum(m0 - 1, 0))
            cum_r = cumdt_smem.index(m).load(gl.SliceLayout(1, a_y))
            r = gl.exp2(cum_r - ref)
            ay = _scores(cb_j, cumdt_smem, m, 0, cum_r, ref, r, offs_ra, offs_ka, BLOCK)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # C tile m's dot is done: its slot takes C tile m + 2.
            gl.thread_barrier()
            rows_c = _rows(t0, (m + 2) * BLOCK + offs_r, length, T)
            async_copy.async_copy_global_to_shared(
                bc_smem.index((ROWS + m + 2) % NBUF), c_cols + rows_c[:, None] * stride_c_t
            )  # fmt: skip
            async_copy.commit_group()
            cum_y = cumdt_smem.index(m).load(gl.SliceLayout(1, mma_y))
            acc = acc * gl.exp2(cum_y)[:, None]
            # The row's tiles j = 0..m (the last is the diagonal), each dot's next operand
            # built while it runs.
            for j in range(0, m + 1):
                acc = warpgroup_mma(ay, x_smem.index(j), acc, is_async=True)
                ay_next = ay
                if j < m:
                    cb_after = _cb_tile(cb_ptr, cb_base, m, gl.minimum(j + 2, m), cb_tile, ROWS,
                                        BLOCK)  # fmt: skip
                    ay_next = _scores(cb_next, cumdt_smem, m, j + 1, cum_r, ref, r, offs_ra,
                                      offs_ka, BLOCK)  # fmt: skip
                    cb_next = cb_after
                acc, ay = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ay))
                ay = ay_next
            rows_y = m0 + offs_ry
            mask_y = (rows_y < length)[:, None] & (offs_py < P)[None, :]
            if HAS_D:
                x_m = x_smem.index(m).load(mma_y).to(gl.float32)
                acc += gl.load(D_ptr + head).to(gl.float32) * x_m
            if HAS_Z:
                zg = gl.load(
                    z_ptr + (t0 + rows_y)[:, None] * stride_z_t + head * stride_z_h
                    + offs_py[None, :],
                    mask=mask_y, other=0.0,
                ).to(gl.float32)  # fmt: skip
                acc *= zg / (1.0 + gl.exp(-zg))
            out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), ld)
            rows_o = m0 + offs_r
            gl.store(
                y_ptr + (t0 + rows_o)[:, None] * stride_y_t + head * stride_y_h
                + offs_pc[None, :],
                out, mask=(rows_o < length)[:, None],
            )  # fmt: skip
        # No copy may land after the program exits (partial chunks stop early).
        async_copy.wait_group(0)


def launch_hopper_scan(
    x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor | None,
    D: torch.Tensor | None, y: torch.Tensor, cb: torch.Tensor, layout: dict[str, torch.Tensor],
    ssm_state: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor,
    ring: torch.Tensor, counters: torch.Tensor,
) -> None:  # fmt: skip
    """Launch the fused kernel (after ssd_scan.py's cumsum and C.B^T launches).

    `ring` holds >= 2 * H * P * N float32; `counters` is [1 + H] int32, zeroed.
    """
    T, H, P = x.shape
    G, N = B.shape[1:]
    num_chunk_ids = layout["chunk_len"].shape[0]
    z_strides = z.stride()[:2] if z is not None else (0, 0)
    _ssd_chunk_scan_hopper_kernel[(num_chunk_ids * H,)](
        x, B, C, z, D, y, cb, layout["dt"], layout["cum"],
        layout["chunk_start"], layout["chunk_len"], layout["chunk_seq"],
        layout["seq_first_chunk"], state_slots, has_initial_state.to(torch.int8), ssm_state,
        ring, counters, counters[1:],
        T, H, H // G,
        x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        *z_strides, y.stride(0), y.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HAS_D=D is not None, HAS_Z=z is not None, CHUNK=CHUNK, BLOCK=BLOCK, P=P, N=N,
        num_warps=NUM_WARPS,
    )  # fmt: skip
