"""Experiment (NEVER RUN ON A GPU YET): a warp-specialised Gluon SSD scan kernel.

The design the fourth session's measurements point at (docs/kernels_notes.md): one CTA
per head walks its chunks, as in ssmserve/kernels/ssd_scan_hopper.py, but its work is
split over partitions that sync through mbarriers instead of CTA-wide barriers:

- loader (1 warp): TMA copies of x, B and C, cp.async of cum and dt, a chunk ahead;
- state (the default partition, 4 warps): phase 1 and the state chain; it hands each
  chunk's entering state S_in (bf16) to the output partitions through shared memory, so
  chunk c + 1's state update overlaps chunk c's outputs;
- two output partitions (4 warps each): row blocks {0, 3} and {1, 2} of every chunk (5
  tiles each, none of them zero), 64 rows per dot.

It compiles for sm_90 on a CPU machine:

    PYTHONPATH=$PWD python benchmarks/kernels/experiments/ssd_gluon_ws.py --compile

(217 KB of shared memory, 128 registers, 8 bytes of spills at this session's end). On an
H100 or H200, without --compile, it checks the kernel against the Triton-language one and
times both at 32k tokens, Bamba-9B dims; run it under `timeout`, since a wrong barrier
phase hangs. Expect to debug it: the barrier phases, the arrive counts (one arrive per
4-warp partition, 32 cp.async arrivals from the loader warp) and the register split
between partitions have not met a GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

from ssmserve.kernels import ssd_scan, ssd_scan_hopper
from ssmserve.kernels.ssd_scan_hopper import HAS_GLUON, jit

if HAS_GLUON:  # the Gluon names ssd_scan_hopper imported
    from ssmserve.kernels.ssd_scan_hopper import (
        TensorDescriptor,
        async_copy,
        fence_async_shared,
        gl,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
else:
    gl = ssd_scan_hopper.gl

CHUNK_TOKENS = 256
CHUNK = gl.constexpr(CHUNK_TOKENS) if HAS_GLUON else CHUNK_TOKENS
BLOCK = gl.constexpr(64) if HAS_GLUON else 64
# NOTE: constexpr arguments passed through gl.warp_specialize reach the partitions as
# runtime values, so the partitions read CHUNK and BLOCK as globals and P, N from the
# shapes of the shared buffers; D is always given (zeros when the model has none) and
# z is not supported.
# mbarriers, in this order in one allocation: x full/empty and cum-dt full/empty (two
# stages each), B full/empty, C full/empty, S_in full/empty.
X_FULL, X_EMPTY, V_FULL, V_EMPTY = (gl.constexpr(i) for i in (0, 2, 4, 6))
B_FULL, B_EMPTY, C_FULL, C_EMPTY, S_FULL, S_EMPTY = (gl.constexpr(i) for i in range(8, 14))
NUM_BARS = gl.constexpr(14)


@jit
def _mma(a, b, acc, use_acc: gl.constexpr = True):
    acc = warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)
    acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
    return acc


@jit
def _loader(descs, bufs, bars, ptrs, scal):
    x_desc, b_desc, c_desc = descs
    x_smem, b_smem, c_smem, s_smem, vec_smem = bufs
    P: gl.constexpr = x_smem.shape[2]
    N: gl.constexpr = b_smem.shape[1]
    chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr = ptrs[:4]
    cum_buf_ptr, dt_buf_ptr = ptrs[4:6]
    num_chunks, head, group, H = scal[:4]
    HALF: gl.constexpr = CHUNK // 2
    vec_l: gl.constexpr = gl.BlockedLayout([CHUNK // 32], [32], [1], [0])
    offs = gl.arange(0, CHUNK, layout=vec_l)
    for c in range(0, num_chunks):
        stage = c % 2
        ph2 = (c // 2) % 2
        ph1 = c % 2
        row = gl.load(chunk_start_ptr + c)
        # Rows past a chunk's end are the next sequence's (or zeros past T): they meet
        # zero weights, zero C.B^T columns, or outputs that are not stored.
        mbarrier.wait(bars.index(X_EMPTY + stage), ph2 ^ 1)
        mbarrier.expect(bars.index(X_FULL + stage), 2 * x_desc.block_type.nbytes)
        x_stage = x_smem.index(stage)
        tma.async_copy_global_to_shared(x_desc, [row, head * P], bars.index(X_FULL + stage),
                                        x_stage.slice(0, HALF))  # fmt: skip
        tma.async_copy_global_to_shared(x_desc, [row + HALF, head * P], bars.index(X_FULL + stage),
                                        x_stage.slice(HALF, HALF))  # fmt: skip
        mbarrier.wait(bars.index(V_EMPTY + stage), ph2 ^ 1)
        base = (c * H + head) * CHUNK
        async_copy.async_copy_global_to_shared(vec_smem.index(2 * stage), cum_buf_ptr + base + offs)
        async_copy.async_copy_global_to_shared(vec_smem.index(2 * stage + 1),
                                               dt_buf_ptr + base + offs)  # fmt: skip
        async_copy.mbarrier_arrive(bars.index(V_FULL + stage), increment_count=False)
        mbarrier.wait(bars.index(B_EMPTY), ph1 ^ 1)
        mbarrier.expect(bars.index(B_FULL), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [row, group * N], bars.index(B_FULL), b_smem)
        mbarrier.wait(bars.index(C_EMPTY), ph1 ^ 1)
        mbarrier.expect(bars.index(C_FULL), c_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(c_desc, [row, group * N], bars.index(C_FULL), c_smem)


@jit
def _state(descs, bufs, bars, ptrs, scal):
    # Phase 1 and the chain: S_out = exp(total) S_in + sum_t exp(total - cum_t) dt_t x_t^T B_t.
    x_smem, b_smem, c_smem, s_smem, vec_smem = bufs
    P: gl.constexpr = x_smem.shape[2]
    N: gl.constexpr = b_smem.shape[1]
    chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr = ptrs[:4]
    cum_buf_ptr, dt_buf_ptr = ptrs[4:6]
    state_ptr, state_slots_ptr, has_init_ptr = ptrs[9:12]
    num_chunks, head, group, H = scal[:4]
    stride_s_slot, stride_s_h, stride_s_p = scal[5:8]
    ROWS: gl.constexpr = CHUNK // BLOCK
    dtype: gl.constexpr = x_smem.dtype
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16]
    )
    a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
    offs_ps = gl.arange(0, P, layout=gl.SliceLayout(1, mma_s))
    offs_ns = gl.arange(0, N, layout=gl.SliceLayout(0, mma_s))
    state = gl.zeros([P, N], gl.float32, mma_s)
    for c in range(0, num_chunks):
        stage = c % 2
        ph2 = (c // 2) % 2
        ph1 = c % 2
        seq = gl.load(chunk_seq_ptr + c)
        first = gl.load(seq_first_chunk_ptr + seq)
        last = gl.load(seq_first_chunk_ptr + seq + 1)
        slot = gl.load(state_slots_ptr + seq).to(gl.int64)
        total = gl.load(cum_buf_ptr + (c * H + head) * CHUNK + CHUNK - 1)
        if c == first:
            has_init = gl.load(has_init_ptr + seq) != 0
            state = gl.load(
                state_ptr + slot * stride_s_slot + head * stride_s_h
                + offs_ps[:, None] * stride_s_p + offs_ns[None, :],
                mask=(offs_ps < P)[:, None] & has_init, other=0.0,
            ).to(gl.float32)  # fmt: skip
        # Hand S_in to the output partitions.
        mbarrier.wait(bars.index(S_EMPTY), ph1 ^ 1)
        s_smem.store(state.to(dtype))
        fence_async_shared()
        mbarrier.arrive(bars.index(S_FULL), count=1)

        mbarrier.wait(bars.index(V_FULL + stage), ph2)
        mbarrier.wait(bars.index(X_FULL + stage), ph2)
        mbarrier.wait(bars.index(B_FULL), ph1)
        cum = vec_smem.index(2 * stage)
        dts = vec_smem.index(2 * stage + 1)
        x_c = x_smem.index(stage)
        acc = state * gl.exp2(total)
        for k in gl.static_range(ROWS):
            w = gl.exp2(total - cum.slice(k * BLOCK, BLOCK).load(gl.SliceLayout(0, a_s)))
            w *= dts.slice(k * BLOCK, BLOCK).load(gl.SliceLayout(0, a_s))
            xT = x_c.slice(k * BLOCK, BLOCK).permute((1, 0)).load(a_s)
            a = (xT.to(gl.float32) * w[None, :]).to(dtype)
            acc = _mma(a, b_smem.slice(k * BLOCK, BLOCK), acc)
        # Generic reads of x and cum/dt are ordered before the copies that overwrite them.
        fence_async_shared()
        mbarrier.arrive(bars.index(B_EMPTY), count=1)
        mbarrier.arrive(bars.index(X_EMPTY + stage), count=1)
        mbarrier.arrive(bars.index(V_EMPTY + stage), count=1)
        state = acc
        if c + 1 == last:
            gl.store(
                state_ptr + slot * stride_s_slot + head * stride_s_h
                + offs_ps[:, None] * stride_s_p + offs_ns[None, :],
                state.to(state_ptr.dtype.element_ty),
            )  # fmt: skip


@jit
def _tile_operand(cb_ptr, cb_base, cum, dts, m, j, ref, cum_i, offs_r, offs_k,
                  ROWS: gl.constexpr, BLOCK: gl.constexpr):  # fmt: skip
    # C.B^T tile (m, j) with its decays: j < m as exp(cum_i - ref) exp(ref - cum_k) dt_k
    # (both exponents <= 0; the row part is applied here too), the diagonal element-wise
    # with -inf above it before the exp.
    cb = gl.load(cb_ptr + cb_base + ((m * ROWS + j) * BLOCK + offs_r)[:, None] * BLOCK
                 + offs_k[None, :]).to(gl.float32)  # fmt: skip
    cum_k = cum.slice(j * BLOCK, BLOCK).load(offs_k.type.layout)
    dt_k = dts.slice(j * BLOCK, BLOCK).load(offs_k.type.layout)
    if j < m:
        a = cb * gl.exp2(cum_i - ref)[:, None] * (gl.exp2(ref - cum_k) * dt_k)[None, :]
    else:
        causal = offs_r[:, None] >= offs_k[None, :]
        a = cb * gl.exp2(gl.where(causal, cum_i[:, None] - cum_k[None, :], -float("inf")))
        a = a * dt_k[None, :]
    return a.to(gl.bfloat16)


@jit
def _out_block(acc, m: gl.constexpr, cum, dts, x_c, cb_ptr, cb_base, cum_row, D_ptr, y_ptr, head,
               t0, length, stride_y_t, stride_y_h, offs_ra, offs_ka, offs_ry, offs_py):  # fmt: skip
    # Row block m: acc (C_m S_in) scaled by exp(cum_i), + its C.B^T tiles times x, + D x.
    ROWS: gl.constexpr = CHUNK // BLOCK
    mma_y: gl.constexpr = acc.type.layout
    P: gl.constexpr = x_c.shape[1]
    acc = acc * gl.exp2(cum.slice(m * BLOCK, BLOCK).load(gl.SliceLayout(1, mma_y)))[:, None]
    cum_i = cum.slice(m * BLOCK, BLOCK).load(offs_ra.type.layout)
    ref = gl.load(cum_row + m * BLOCK) if m > 0 else 0.0  # cum before the block
    for j in gl.static_range(m + 1):
        a = _tile_operand(cb_ptr, cb_base, cum, dts, m, j, ref, cum_i, offs_ra, offs_ka, ROWS,
                          BLOCK)  # fmt: skip
        acc = _mma(a, x_c.slice(j * BLOCK, BLOCK), acc)
    rows = m * BLOCK + offs_ry
    mask = (rows < length)[:, None] & (offs_py < P)[None, :]
    x_m = x_c.slice(m * BLOCK, BLOCK).load(mma_y).to(gl.float32)
    acc += gl.load(D_ptr + head).to(gl.float32) * x_m
    gl.store(y_ptr + (t0 + rows)[:, None] * stride_y_t + head * stride_y_h + offs_py[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@jit
def _outputs(descs, bufs, bars, ptrs, scal, M_A: gl.constexpr, M_B: gl.constexpr):
    # Row blocks M_A and M_B of every chunk: exp(cum_i) C_i S_in + the C.B^T tiles of the
    # block times x, + D x, stored.
    x_smem, b_smem, c_smem, s_smem, vec_smem = bufs
    P: gl.constexpr = x_smem.shape[2]
    chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr = ptrs[:4]
    cum_buf_ptr, dt_buf_ptr, cb_ptr, D_ptr, y_ptr = ptrs[4:9]
    num_chunks, head, group, H, heads_per_group = scal[:5]
    stride_y_t, stride_y_h = scal[8:10]
    ROWS: gl.constexpr = CHUNK // BLOCK
    mma_y: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P, 16]
    )
    a_y: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_y, k_width=2)
    offs_ra = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, a_y))
    offs_ka = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, a_y))
    offs_ry = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_y))
    offs_py = gl.arange(0, P, layout=gl.SliceLayout(0, mma_y))
    zeros = gl.zeros([BLOCK, P], gl.float32, mma_y)
    for c in range(0, num_chunks):
        stage = c % 2
        ph2 = (c // 2) % 2
        ph1 = c % 2
        t0 = gl.load(chunk_start_ptr + c).to(gl.int64)
        length = gl.load(chunk_len_ptr + c)
        cb_base = (c * (H // heads_per_group) + group) * (ROWS * ROWS * BLOCK * BLOCK)
        cum_row = cum_buf_ptr + (c * H + head) * CHUNK - 1
        mbarrier.wait(bars.index(S_FULL), ph1)
        mbarrier.wait(bars.index(C_FULL), ph1)
        acc_a = _mma(c_smem.slice(M_A * BLOCK, BLOCK), s_smem.permute((1, 0)), zeros, False)
        acc_b = _mma(c_smem.slice(M_B * BLOCK, BLOCK), s_smem.permute((1, 0)), zeros, False)
        mbarrier.arrive(bars.index(C_EMPTY), count=1)
        mbarrier.arrive(bars.index(S_EMPTY), count=1)
        mbarrier.wait(bars.index(V_FULL + stage), ph2)
        mbarrier.wait(bars.index(X_FULL + stage), ph2)
        cum = vec_smem.index(2 * stage)
        dts = vec_smem.index(2 * stage + 1)
        x_c = x_smem.index(stage)
        _out_block(acc_a, M_A, cum, dts, x_c, cb_ptr, cb_base, cum_row, D_ptr, y_ptr, head, t0,
                   length, stride_y_t, stride_y_h, offs_ra, offs_ka, offs_ry, offs_py)  # fmt: skip
        _out_block(acc_b, M_B, cum, dts, x_c, cb_ptr, cb_base, cum_row, D_ptr, y_ptr, head, t0,
                   length, stride_y_t, stride_y_h, offs_ra, offs_ka, offs_ry, offs_py)  # fmt: skip
        fence_async_shared()
        mbarrier.arrive(bars.index(X_EMPTY + stage), count=1)
        mbarrier.arrive(bars.index(V_EMPTY + stage), count=1)


@jit
def _out_03(descs, bufs, bars, ptrs, scal):
    _outputs(descs, bufs, bars, ptrs, scal, 0, 3)


@jit
def _out_12(descs, bufs, bars, ptrs, scal):
    _outputs(descs, bufs, bars, ptrs, scal, 1, 2)


@jit
def _ssd_scan_ws_kernel(
    x_desc, b_desc, c_desc, D_ptr, y_ptr, cb_ptr, dt_buf_ptr, cum_buf_ptr,
    chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr, num_seqs,
    state_slots_ptr, has_init_ptr, state_ptr,
    H, heads_per_group, stride_y_t, stride_y_h, stride_s_slot, stride_s_h, stride_s_p,
    P: gl.constexpr, N: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = x_desc.dtype
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P, N], dtype)
    vec_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, P], dtype)
    x_smem = gl.allocate_shared_memory(dtype, [2, CHUNK, P], x_sl)
    b_smem = gl.allocate_shared_memory(dtype, [CHUNK, N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [CHUNK, N], c_desc.layout)
    s_smem = gl.allocate_shared_memory(dtype, [P, N], s_sl)
    vec_smem = gl.allocate_shared_memory(gl.float32, [4, CHUNK], vec_sl)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BARS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(bars.index(X_FULL + s), count=1)
        mbarrier.init(bars.index(X_EMPTY + s), count=3)  # state + two output partitions
        mbarrier.init(bars.index(V_FULL + s), count=32)  # the loader warp's cp.async arrivals
        mbarrier.init(bars.index(V_EMPTY + s), count=3)
    mbarrier.init(bars.index(B_FULL), count=1)
    mbarrier.init(bars.index(B_EMPTY), count=1)
    mbarrier.init(bars.index(C_FULL), count=1)
    mbarrier.init(bars.index(C_EMPTY), count=2)
    mbarrier.init(bars.index(S_FULL), count=1)
    mbarrier.init(bars.index(S_EMPTY), count=2)
    fence_async_shared()
    gl.thread_barrier()

    head = gl.program_id(0)
    group = head // heads_per_group
    num_chunks = gl.load(seq_first_chunk_ptr + num_seqs)
    descs = (x_desc, b_desc, c_desc)
    bufs = (x_smem, b_smem, c_smem, s_smem, vec_smem)
    ptrs = (chunk_start_ptr, chunk_len_ptr, chunk_seq_ptr, seq_first_chunk_ptr, cum_buf_ptr,
            dt_buf_ptr, cb_ptr, D_ptr, y_ptr, state_ptr, state_slots_ptr, has_init_ptr)  # fmt: skip
    scal = (num_chunks, head, group, H, heads_per_group, stride_s_slot, stride_s_h, stride_s_p,
            stride_y_t, stride_y_h)  # fmt: skip
    worker_args = (descs, bufs, bars, ptrs, scal)
    gl.warp_specialize(
        [
            (_state, worker_args),
            (_loader, worker_args),
            (_out_03, worker_args),
            (_out_12, worker_args),
        ],
        [1, 4, 4],
        [40, 168, 168],
    )


def launch_ws(x, B, C, z, D, y, cb, layout, ssm_state, state_slots, has_initial_state):
    """Same arguments as ssd_scan_hopper.launch_hopper_scan."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    bf16 = gl.bfloat16
    x_layout = gl.NVMMASharedLayout.get_default_for([CHUNK_TOKENS // 2, P], bf16)
    x_desc = TensorDescriptor(x, [T, H * P], [x.stride(0), 1], [CHUNK_TOKENS // 2, P], x_layout)
    bc_layout = gl.NVMMASharedLayout.get_default_for([CHUNK_TOKENS, N], bf16)
    b_desc = TensorDescriptor(B, [T, G * N], [B.stride(0), 1], [CHUNK_TOKENS, N], bc_layout)
    c_desc = TensorDescriptor(C, [T, G * N], [C.stride(0), 1], [CHUNK_TOKENS, N], bc_layout)
    assert z is None, "the experiment has no gate"
    D = D if D is not None else torch.zeros(H, device=x.device)
    _ssd_scan_ws_kernel[(H,)](
        x_desc, b_desc, c_desc, D, y, cb, layout["dt"], layout["cum"],
        layout["chunk_start"], layout["chunk_len"], layout["chunk_seq"],
        layout["seq_first_chunk"], state_slots.shape[0],
        state_slots, has_initial_state.to(torch.int8), ssm_state,
        H, H // G, y.stride(0), y.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        P=P, N=N, num_warps=4, maxnreg=128,
    )  # fmt: skip


def compile_only() -> None:
    """Compile for sm_90 here (no GPU): registers, spills, shared memory."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import ptxas_report

    descs = {"x_desc": (CHUNK_TOKENS // 2, 64), "b_desc": (CHUNK_TOKENS, 128),
             "c_desc": (CHUNK_TOKENS, 128)}  # fmt: skip
    options = {"num_warps": 4, "maxnreg": 128}
    print(ptxas_report.gluon_report(_ssd_scan_ws_kernel, dict(P=64, N=128), descs, options))


def check_and_time() -> None:
    """On an H100/H200: against the Triton-language kernel at 32k, then both timed."""
    import triton.testing

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_ssd as bs
    from bench_common import rel_err

    original = ssd_scan_hopper.launch_hopper_scan
    scan = ssd_scan.ssd_scan_varlen_triton
    for lengths in ([32768], [512 - 37, 1, 700, 300, 64, 1100, 900, 530 + 26]):
        inp = bs.make_inputs(lengths, 128, 64, 128, 1, True)
        pool = inp["ssm_state"].clone()
        os.environ["SSMSERVE_SSD_GLUON"] = "0"
        y_ref = bs.call(ssd_scan.ssd_scan_varlen_triton, inp)
        ref_state = inp["ssm_state"].clone()
        inp["ssm_state"] = pool
        os.environ["SSMSERVE_SSD_GLUON"] = "1"
        ssd_scan_hopper.launch_hopper_scan = launch_ws
        try:
            y = bs.call(ssd_scan.ssd_scan_varlen_triton, inp)
            torch.cuda.synchronize()
            print(f"{len(lengths)} seq(s): y rel err {rel_err(y, y_ref):.2e}, "
                  f"state {rel_err(inp['ssm_state'], ref_state):.2e}", flush=True)  # fmt: skip
            if len(lengths) == 1:
                ms = triton.testing.do_bench(functools.partial(bs.call, scan, inp))
                print(f"warp-specialised: {ms:.3f} ms", flush=True)
        finally:
            ssd_scan_hopper.launch_hopper_scan = original
        if len(lengths) == 1:
            os.environ["SSMSERVE_SSD_GLUON"] = "0"
            ms = triton.testing.do_bench(functools.partial(bs.call, scan, inp))
            print(f"Triton-language: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile only (any machine)")
    if parser.parse_args().compile:
        os.environ.pop("TRITON_INTERPRET", None)
        compile_only()
    else:
        check_and_time()
