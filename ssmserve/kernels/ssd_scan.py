"""Mamba2 prefill: variable-length SSD (state space duality) chunked scan.

Per head h (group g = h // (H // G)), for each token t of a sequence:

    dt_t  = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      S: [P, N]
    y_t   = S_t @ C_t + D * x_t;   y_t *= silu(z_t) if z is given

S_{-1} is the sequence's slot state if has_initial_state else zeros; the final S is
written back to the slot. Snapshots (prefix caching) also write S after the first k
tokens of a sequence into other rows of the state pool. The chunked form (used by both
twin and kernels) computes, per chunk of L tokens with cum_i = sum_{k<=i} dt_k A:

    y_i = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) (S_in @ C_i)
    S_out = exp(cum_L) S_in + sum_j exp(cum_L - cum_j) dt_j outer(x_j, B_j)

The twin walks the chunks in order; the Triton kernels compute the second sum of S_out
for all chunks in parallel, chain only the states, then compute y for all chunks in
parallel (see the comment above the kernels).
"""

from __future__ import annotations

import math
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
    interpret_mode,
    launch_config,
    lazy_jit,
    next_pow2,
    prev_pow2,
    process_dt,
    tl,
)


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
    start_positions: torch.Tensor | None,
    snapshots: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
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
    S = check_varlen_shapes(cu_seqlens, state_slots, has_initial_state)
    if start_positions is not None:
        check_shape("start_positions", start_positions, [S])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    check_snapshot_shapes(*snapshots)
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
    start_positions: torch.Tensor | None = None,
    snapshot_seqs: torch.Tensor | None = None,
    snapshot_lens: torch.Tensor | None = None,
    snapshot_slots: torch.Tensor | None = None,
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
        start_positions: [S] int or None (= 0): absolute position of each sequence's first
            token. Chunks are aligned to multiples of chunk_size in absolute positions: a
            sequence resumed mid-chunk starts with a shortened chunk, so its later chunks
            are the ones a single pass over the whole sequence would have made.
        snapshot_seqs, snapshot_lens, snapshot_slots: [M] int each, or None (all three
            or none): ssm_state[snapshot_slots[i]] receives the state of sequence
            snapshot_seqs[i] after its first snapshot_lens[i] tokens (1 <= lens <= its
            length; rows that no sequence of the call uses). The twin takes any length;
            the Triton kernels need each snapshot on a chunk boundary: start position +
            length a multiple of `chunk_tokens(chunk_size)`, or the sequence's end.

    Returns:
        y: [T, H, P] in x.dtype.
    """
    snapshots = (snapshot_seqs, snapshot_lens, snapshot_slots)
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
        start_positions,
        snapshots,
    )
    seqs = check_varlen(cu_seqlens, state_slots, has_initial_state, T, ssm_state.shape[0])
    cuts = check_snapshots(*snapshots, seqs, ssm_state.shape[0])
    offsets = [0] * len(seqs) if start_positions is None else start_positions.tolist()
    heads_per_group = H // G
    dt_all = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    A_gh = A.float().view(G, heads_per_group)
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    for index, ((start, end, slot, has_init), position) in enumerate(
        zip(seqs, offsets, strict=True)
    ):
        if has_init:
            state = ssm_state[slot].float().view(G, heads_per_group, P, N)
        else:
            state = x.new_zeros(G, heads_per_group, P, N, dtype=torch.float32)
        snaps = cuts.get(index, {})
        # Chunk ends at absolute multiples of chunk_size, and at snapshots.
        ends = set(range(start + chunk_size - position % chunk_size, end, chunk_size))
        ends.update(start + k for k in snaps)
        ends.add(end)
        c0 = start
        for c1 in sorted(ends):
            if c1 == c0:
                continue  # an empty sequence
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
            if c1 - start in snaps:
                ssm_state[snaps[c1 - start]] = state.reshape(H, P, N).to(ssm_state.dtype)
            c0 = c1
        ssm_state[slot] = state.reshape(H, P, N).to(ssm_state.dtype)
    if D is not None:
        y += D.float()[:, None] * x.float()
    if z is not None:
        y *= F.silu(z.float())
    return y.to(x.dtype)


# ---------------------------------------------------------------------------- Triton
#
# The Triton path is the chunked SSD decomposition in three launches, no host sync:
#   1. _ssd_chunk_cumsum_kernel: chunk metadata from cu_seqlens and start_positions
#      (chunks align to absolute positions, so a sequence resumed mid-chunk starts with a
#      shortened chunk; an empty sequence owns one empty chunk), processed dt and its
#      chunk-local cumsum of dt*A, kept in log2 units (dt*A*log2(e)) so that every decay
#      below, written exp(...) in the comments, is one exp2.
#   2. _ssd_chunk_cb_kernel: the BLOCK x BLOCK tiles of C B^T on and below the diagonal
#      per (chunk, group), shared by the group's heads.
#   3. _ssd_chunk_scan_kernel: one program per (chunk, head, block of P) does the rest:
#      the chunk's own end-state contribution (all chunks in parallel), then the one
#      sequential step S_out = exp(sum dA) S_in + contribution, chained from the previous
#      chunk's program through a flag per (head, P block) (a "chained scan": only this
#      step waits), then the chunk's outputs BLOCK rows at a time from the entering state
#      and the C.B^T tiles of the row block, + D x, gated by silu(z).
# Chained states never leave L2: they go through a two-deep ring per head. Programs take
# their (chunk, head) from an atomic ticket in chunk-major order, so every program a
# program waits on has started before it (no deadlock whatever order the GPU launches
# programs in), and the interpreter, which runs programs one by one, never waits.
# Chunk ids run over an upper bound, cdiv(T, chunk) + 2 S, so grids and buffers never
# depend on device values; ids past the real chunks belong to no sequence and do nothing.


@lazy_jit(
    do_not_specialize=(
        "cu_seqlens_ptr",
        "start_pos_ptr",
        "chunk_start_ptr",
        "chunk_len_ptr",
        "chunk_seq_ptr",
        "num_seqs",
        "snapshot_seqs_ptr",
        "snapshot_lens_ptr",
        "snapshot_rows_ptr",
        "snapshot_row_ptr",
        "num_snapshots",
    )
)
def _ssd_chunk_cumsum_kernel(
    dt_ptr,
    A_ptr,
    dt_bias_ptr,
    cu_seqlens_ptr,
    start_pos_ptr,
    dt_out_ptr,
    cum_out_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    chunk_seq_ptr,
    seq_first_chunk_ptr,
    snapshot_seqs_ptr,
    snapshot_lens_ptr,
    snapshot_rows_ptr,
    snapshot_row_ptr,
    num_seqs,
    num_snapshots,
    H,
    dt_min,
    dt_max,
    stride_dt_t,
    stride_dt_h,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    CLAMP_DT: tl.constexpr,
    HAS_START_POS: tl.constexpr,
    HAS_SNAPSHOTS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
):
    chunk = tl.program_id(0)
    pid_h = tl.program_id(1)
    # Which sequence owns this chunk id, without a search: sequence s owns chunk ids
    # [first_chunk[s], first_chunk[s] + max(1, cdiv(offset_s + len_s, CHUNK))), where
    # offset_s is its first token's absolute position mod CHUNK (its first chunk is
    # shortened by that much, so the others align); at most one sequence matches. The
    # sequences are walked BLOCK_SEQ at a time (a fixed block, so that one compiled
    # kernel serves every number of sequences), carrying the chunks counted so far.
    first_program = (chunk == 0) & (pid_h == 0)
    start = 0
    end = 0
    seq = -1
    seq_offset = 0  # the owner's first-token position mod CHUNK
    index_in_seq = 0  # which of its owner's chunks this one is
    chunks_before = 0
    for s0 in range(0, num_seqs, BLOCK_SEQ):
        offs_s = s0 + tl.arange(0, BLOCK_SEQ)
        mask_s = offs_s < num_seqs
        seq_start = tl.load(cu_seqlens_ptr + offs_s, mask=mask_s, other=0).to(tl.int32)
        seq_end = tl.load(cu_seqlens_ptr + offs_s + 1, mask=mask_s, other=0).to(tl.int32)
        if HAS_START_POS:
            offset = (tl.load(start_pos_ptr + offs_s, mask=mask_s, other=0) % CHUNK).to(tl.int32)
        else:
            offset = tl.zeros((BLOCK_SEQ,), dtype=tl.int32)
        num_chunks = tl.maximum((offset + seq_end - seq_start + CHUNK - 1) // CHUNK, 1)
        num_chunks = tl.where(mask_s, num_chunks, 0)
        last_chunk = chunks_before + tl.cumsum(num_chunks, 0)
        first_chunk = last_chunk - num_chunks
        owner = (first_chunk <= chunk) & (chunk < last_chunk)
        k = chunk - first_chunk  # index of this chunk within its sequence
        start += tl.sum(tl.where(owner, seq_start + tl.maximum(k * CHUNK - offset, 0), 0), 0)
        end += tl.sum(
            tl.where(owner, tl.minimum(seq_end, seq_start + (k + 1) * CHUNK - offset), 0), 0
        )
        seq = tl.maximum(seq, tl.max(tl.where(owner, offs_s, -1), 0))
        seq_offset += tl.sum(tl.where(owner, offset, 0), 0)
        index_in_seq += tl.sum(tl.where(owner, k, 0), 0)
        tl.store(seq_first_chunk_ptr + offs_s, first_chunk, mask=mask_s & first_program)
        chunks_before += tl.sum(num_chunks, 0)
    length = tl.maximum(end - start, 0)
    tl.store(chunk_start_ptr + chunk, start, mask=pid_h == 0)
    tl.store(chunk_len_ptr + chunk, length, mask=pid_h == 0)
    tl.store(chunk_seq_ptr + chunk, seq, mask=pid_h == 0)
    tl.store(seq_first_chunk_ptr + num_seqs, chunks_before, mask=first_program)
    if HAS_SNAPSHOTS:
        # The checkpoint row this chunk's end state goes to (-1: none): a snapshot of
        # sequence s after n tokens ends s's chunk cdiv(offset_s + n, CHUNK) - 1.
        row = -1
        for m0 in range(0, num_snapshots, BLOCK_SEQ):
            offs_m = m0 + tl.arange(0, BLOCK_SEQ)
            mask_m = offs_m < num_snapshots
            snap_seq = tl.load(snapshot_seqs_ptr + offs_m, mask=mask_m, other=-1).to(tl.int32)
            snap_len = tl.load(snapshot_lens_ptr + offs_m, mask=mask_m, other=0).to(tl.int32)
            snap_row = tl.load(snapshot_rows_ptr + offs_m, mask=mask_m, other=-1).to(tl.int32)
            ends_here = (seq_offset + snap_len + CHUNK - 1) // CHUNK - 1 == index_in_seq
            match = mask_m & (snap_seq == seq) & ends_here
            row = tl.maximum(row, tl.max(tl.where(match, snap_row, -1), 0))
        tl.store(snapshot_row_ptr + chunk, row, mask=pid_h == 0)

    offs_l = tl.arange(0, CHUNK)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    mask = (offs_l < length)[:, None] & mask_h[None, :]
    t = start.to(tl.int64) + offs_l
    dt = tl.load(
        dt_ptr + t[:, None] * stride_dt_t + offs_h[None, :] * stride_dt_h, mask=mask, other=0.0
    ).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    if CLAMP_DT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    # Tokens past the chunk's end get dt = 0: no decay and no input, so the cumsum at the
    # last position is the chunk's total and later stages need no length masks on it.
    dt = tl.where(mask, dt, 0.0)
    # In log2 units (A * log2(e)): the scan's decays are then bare exp2, one instruction.
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32) * 1.4426950408889634
    cum = tl.cumsum(dt * A[None, :], 0)
    out = (chunk.to(tl.int64) * H + offs_h[None, :]) * CHUNK + offs_l[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask_h[None, :])
    tl.store(cum_out_ptr + out, cum, mask=mask_h[None, :])


@lazy_jit(do_not_specialize=("chunk_start_ptr", "chunk_len_ptr"))
def _ssd_chunk_cb_kernel(
    B_ptr,
    C_ptr,
    cb_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    N,
    stride_b_t,
    stride_b_g,
    stride_b_n,
    stride_c_t,
    stride_c_g,
    stride_c_n,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # The BLOCK x BLOCK tiles (m, j), j <= m, of C B^T per (chunk, group), shared by the
    # group's heads; stored as [chunk, group, CHUNK // BLOCK (m), CHUNK // BLOCK (j),
    # BLOCK, BLOCK] (tiles above the diagonal are never written nor read).
    ROWS: tl.constexpr = CHUNK // BLOCK
    m = tl.program_id(0) // ROWS
    j = tl.program_id(0) % ROWS
    chunk = tl.program_id(1).to(tl.int64)
    group = tl.program_id(2)
    num_groups = tl.num_programs(2)
    length = tl.load(chunk_len_ptr + chunk)
    if (j <= m) & (m * BLOCK < length):
        t0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
        offs_m = m * BLOCK + tl.arange(0, BLOCK)
        offs_j = j * BLOCK + tl.arange(0, BLOCK)
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        c = tl.load(
            C_ptr
            + (t0 + offs_m)[:, None] * stride_c_t
            + group * stride_c_g
            + offs_n[None, :] * stride_c_n,
            mask=(offs_m < length)[:, None] & mask_n[None, :],
            other=0.0,
        )
        bT = tl.load(
            B_ptr
            + (t0 + offs_j)[None, :] * stride_b_t
            + group * stride_b_g
            + offs_n[:, None] * stride_b_n,
            mask=(offs_j < length)[None, :] & mask_n[:, None],
            other=0.0,
        )
        cb = tl.dot(c.to(DOT_DTYPE), bT.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        offs = tl.arange(0, BLOCK)
        out = (((chunk * num_groups + group) * ROWS + m) * ROWS + j) * BLOCK * BLOCK
        tl.store(
            cb_ptr + out + offs[:, None] * BLOCK + offs[None, :], cb.to(cb_ptr.dtype.element_ty)
        )


@lazy_jit(
    do_not_specialize=(
        "chunk_start_ptr",
        "chunk_len_ptr",
        "chunk_seq_ptr",
        "seq_first_chunk_ptr",
        "state_slots_ptr",
        "has_init_ptr",
        "snapshot_row_ptr",
    )
)
def _ssd_chunk_scan_kernel(
    x_ptr,
    B_ptr,
    C_ptr,
    z_ptr,
    D_ptr,
    y_ptr,
    cb_ptr,
    dt_buf_ptr,
    cum_buf_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    chunk_seq_ptr,
    seq_first_chunk_ptr,
    state_slots_ptr,
    has_init_ptr,
    state_ptr,
    snapshot_row_ptr,
    ring_ptr,
    ticket_ptr,
    published_ptr,
    H,
    heads_per_group,
    P,
    N,
    stride_x_t,
    stride_x_h,
    stride_x_p,
    stride_b_t,
    stride_b_g,
    stride_b_n,
    stride_c_t,
    stride_c_g,
    stride_c_n,
    stride_z_t,
    stride_z_h,
    stride_z_p,
    stride_y_t,
    stride_y_h,
    stride_y_p,
    stride_s_slot,
    stride_s_h,
    stride_s_p,
    stride_s_n,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SNAPSHOTS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    P_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STATE_DOT_DTYPE: tl.constexpr,
    STATE_PRECISION: tl.constexpr,
):
    # One program per (chunk, head, block of P): states are kept as [N, P] (the C.S dot
    # operand as it is, and the contribution's dot has N as its 128-row M side).
    ticket = tl.atomic_add(ticket_ptr, 1)
    chunk = (ticket // (H * P_BLOCKS)).to(tl.int64)
    lane = ticket % (H * P_BLOCKS)  # index of this (head, P block) chain
    head = lane // P_BLOCKS
    seq = tl.load(chunk_seq_ptr + chunk)
    if seq >= 0:
        group = head // heads_per_group
        length = tl.load(chunk_len_ptr + chunk)
        t0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
        base = (chunk * H + head) * CHUNK
        total = tl.load(cum_buf_ptr + base + CHUNK - 1)
        offs_p = (lane % P_BLOCKS) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mask_p = offs_p < P
        mask_n = offs_n < N
        x_head = x_ptr + head * stride_x_h + offs_p[None, :] * stride_x_p

        # 1. The chunk's contribution to its end state, from a zero state:
        #    sum_j exp(total - cum_j) dt_j outer(B_j, x_j), an [N, T] x [T, P] dot per block.
        contrib = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
        # NOTE: a constexpr trip count (masked past the end) keeps the dots pipelined.
        for k0 in range(0, CHUNK, BLOCK_T):
            offs_k = k0 + tl.arange(0, BLOCK_T)
            mask_k = offs_k < length
            t = t0 + offs_k
            # cum is non-increasing (A < 0, dt >= 0), so total - cum <= 0: no overflow.
            weight = tl.exp2(total - tl.load(cum_buf_ptr + base + offs_k))
            weight *= tl.load(dt_buf_ptr + base + offs_k)
            # Scale x (the smaller operand): B goes from memory to the dot as it is.
            x_k = tl.load(
                x_head + t[:, None] * stride_x_t, mask=mask_k[:, None] & mask_p[None, :], other=0.0
            ).to(tl.float32)
            bT = tl.load(
                B_ptr + t[None, :] * stride_b_t + group * stride_b_g + offs_n[:, None] * stride_b_n,
                mask=mask_k[None, :] & mask_n[:, None],
                other=0.0,
            )
            contrib += tl.dot(
                bT.to(DOT_DTYPE),
                (x_k * weight[:, None]).to(DOT_DTYPE),
                input_precision=DOT_PRECISION,
            )

        # 2. The chained step. Wait until the previous chunk id (of any sequence: the ring
        #    below is only safe if chunks publish in order) has published for this chain.
        if chunk > 0:
            seen = tl.atomic_add(published_ptr + lane, 0, sem="acquire")
            while seen < chunk:
                seen = tl.atomic_add(published_ptr + lane, 0, sem="acquire")
        first = tl.load(seq_first_chunk_ptr + seq).to(tl.int64)
        last = tl.load(seq_first_chunk_ptr + seq + 1).to(tl.int64)
        ring_lane = ring_ptr + lane * BLOCK_N * BLOCK_P
        slot_head = state_ptr + tl.load(state_slots_ptr + seq).to(tl.int64) * stride_s_slot
        slot_head += head * stride_s_h
        # NOTE: pointer tensors are formed inside each branch, next to their one use: a
        # state-sized tensor of 64-bit pointers live across the branches costs registers
        # by the hundred and makes the kernel spill.
        if chunk == first:
            has_init = tl.load(has_init_ptr + seq) != 0
            state_in = tl.load(
                slot_head + offs_n[:, None] * stride_s_n + offs_p[None, :] * stride_s_p,
                mask=mask_n[:, None] & mask_p[None, :] & has_init,
                other=0.0,
            ).to(tl.float32)
        else:
            # .cg: read L2, where the previous program wrote, never a stale L1 line.
            state_in = tl.load(
                ring_lane
                + ((chunk - 1) % 2) * (H * P_BLOCKS * BLOCK_N * BLOCK_P)
                + offs_n[:, None] * BLOCK_P
                + tl.arange(0, BLOCK_P)[None, :],
                cache_modifier=".cg",
            )
        state_out = state_in * tl.exp2(total) + contrib
        if HAS_SNAPSHOTS:
            # Prefix caching: the state at this chunk's end, into a checkpoint row.
            snapshot_row = tl.load(snapshot_row_ptr + chunk).to(tl.int64)
            if snapshot_row >= 0:
                tl.store(
                    state_ptr
                    + snapshot_row * stride_s_slot
                    + head * stride_s_h
                    + offs_n[:, None] * stride_s_n
                    + offs_p[None, :] * stride_s_p,
                    state_out.to(state_ptr.dtype.element_ty),
                    mask=mask_n[:, None] & mask_p[None, :],
                )
        if chunk + 1 == last:
            tl.store(
                slot_head + offs_n[:, None] * stride_s_n + offs_p[None, :] * stride_s_p,
                state_out.to(state_ptr.dtype.element_ty),
                mask=mask_n[:, None] & mask_p[None, :],
            )
        else:
            # NOTE: safe to overwrite: the ring entry chunk - 2 wrote was read by chunk - 1
            # before it published, and we saw that publish above.
            tl.store(
                ring_lane
                + (chunk % 2) * (H * P_BLOCKS * BLOCK_N * BLOCK_P)
                + offs_n[:, None] * BLOCK_P
                + tl.arange(0, BLOCK_P)[None, :],
                state_out,
            )
        # Release: every thread's stores above are visible before the flag says so (the
        # barrier orders them before the one thread that performs the release).
        tl.debug_barrier()
        tl.atomic_xchg(published_ptr + lane, (chunk + 1).to(tl.int32), sem="release")

        # 3. Outputs, BLOCK rows at a time, each from the entering state and the chunk's
        #    tokens up to it; nothing is carried from row block to row block but the
        #    entering state as a 16-bit dot operand. Runtime loops (not unrolled) and no
        #    float32 state live here keep the registers low enough for 16 warps per SM,
        #    which is what this latency-bound kernel needs most (docs/kernels.md).
        #    With ref = cum at m0 - 1, the tokens of an earlier row block j enter as
        #    exp(cum_i - ref) * [C.B^T tile (m, j)] x [exp(ref - cum_j) dt_j x_j]: every
        #    exponent is <= 0 (cum is non-increasing), and only the diagonal tile needs the
        #    element-wise causal decay.
        state_op = state_in.to(STATE_DOT_DTYPE)
        ROWS: tl.constexpr = CHUNK // BLOCK
        cb_base = (chunk * (H // heads_per_group) + group) * ROWS * ROWS * BLOCK * BLOCK
        offs_b = tl.arange(0, BLOCK)
        tile = offs_b[:, None] * BLOCK + offs_b[None, :]
        for m0 in range(0, length, BLOCK):
            offs_m = m0 + offs_b
            mask_m = offs_m < length
            mask_mp = mask_m[:, None] & mask_p[None, :]
            t_m = t0 + offs_m
            cum_m = tl.load(cum_buf_ptr + base + offs_m)
            c = tl.load(
                C_ptr
                + t_m[:, None] * stride_c_t
                + group * stride_c_g
                + offs_n[None, :] * stride_c_n,
                mask=mask_m[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc = tl.dot(c.to(STATE_DOT_DTYPE), state_op, input_precision=STATE_PRECISION)
            acc *= tl.exp2(cum_m)[:, None]
            if m0 > 0:
                ref = tl.load(cum_buf_ptr + base + m0 - 1)
                off = tl.zeros((BLOCK, BLOCK_P), dtype=tl.float32)
                for j0 in range(0, m0, BLOCK):
                    offs_j = j0 + offs_b  # all < length: j0 + BLOCK <= m0 < length
                    w = tl.exp2(ref - tl.load(cum_buf_ptr + base + offs_j))
                    w *= tl.load(dt_buf_ptr + base + offs_j)
                    x_j = tl.load(
                        x_head + (t0 + offs_j)[:, None] * stride_x_t,
                        mask=mask_p[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    cb = tl.load(
                        cb_ptr
                        + cb_base
                        + ((m0 // BLOCK) * ROWS + j0 // BLOCK) * BLOCK * BLOCK
                        + tile
                    )
                    off += tl.dot(
                        cb.to(DOT_DTYPE),
                        (x_j * w[:, None]).to(DOT_DTYPE),
                        input_precision=DOT_PRECISION,
                    )
                acc += off * tl.exp2(cum_m - ref)[:, None]
            # The diagonal tile: -inf above the diagonal before exp (cum_i - cum_j > 0
            # there and may overflow).
            dt_m = tl.load(dt_buf_ptr + base + offs_m)
            x_m = tl.load(x_head + t_m[:, None] * stride_x_t, mask=mask_mp, other=0.0)
            cb = tl.load(cb_ptr + cb_base + (m0 // BLOCK) * (ROWS + 1) * BLOCK * BLOCK + tile)
            causal = offs_m[:, None] >= offs_m[None, :]
            decay = tl.exp2(tl.where(causal, cum_m[:, None] - cum_m[None, :], -float("inf")))
            scores = cb.to(tl.float32) * decay * dt_m[None, :]  # decay is 0 above the diagonal
            acc += tl.dot(scores.to(DOT_DTYPE), x_m.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            if HAS_D:
                acc += tl.load(D_ptr + head).to(tl.float32) * x_m.to(tl.float32)
            if HAS_Z:
                z = tl.load(
                    z_ptr
                    + t_m[:, None] * stride_z_t
                    + head * stride_z_h
                    + offs_p[None, :] * stride_z_p,
                    mask=mask_mp,
                    other=0.0,
                ).to(tl.float32)
                acc *= z / (1.0 + tl.exp(-z))
            tl.store(
                y_ptr
                + t_m[:, None] * stride_y_t
                + head * stride_y_h
                + offs_p[None, :] * stride_y_p,
                acc.to(y_ptr.dtype.element_ty),
                mask=mask_mp,
            )


def chunk_tokens(chunk_size: int) -> int:
    """Tokens per chunk of the Triton kernels: chunk_size rounded down to a power of two in
    [16, 256]. Larger chunks mean fewer chained steps and less state work per token, at the
    price of more intra-chunk dot work."""
    return max(16, min(256, prev_pow2(chunk_size)))


def scan_launch_config(
    dtype: torch.dtype, chunk: int, config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Launch parameters of the Triton-language scan kernels, `config` overriding the
    defaults (benchmarks/kernels/bench_ssd.py sweeps them).

    block: rows (and columns) of the output tiles and of the C.B^T tiles, <= chunk.
    block_t: tokens per dot of the end-state contribution, <= chunk.
    block_p: head-dim columns per program (>= 16; the head dim is split into
        cdiv(P, block_p) independent chains).
    num_warps, num_stages, maxnreg: Triton launch options (maxnreg caps registers per
        thread so that more programs fit on an SM; None: no cap).

    The defaults are the fastest measured on the H200 at Bamba-9B dims
    (benchmarks/results/ssd_2026-11-30b_h200.md): for 16-bit inputs, 8 warps held to 128
    registers (two programs, 16 warps per SM); float32 inputs keep 4 warps and no cap:
    their IEEE dots would spill at 128.
    """
    sixteen_bit = dtype != torch.float32
    default = {
        "block": min(64, chunk),
        "block_t": min(64, chunk),
        "block_p": 64,
        "num_warps": 8 if sixteen_bit else 4,
        "num_stages": 1,
        "maxnreg": 128 if sixteen_bit else None,
    }
    cfg = launch_config("ssd_scan_varlen", default, config)
    if cfg["block"] > chunk or cfg["block_t"] > chunk or cfg["block_p"] < 16:
        raise ValueError(
            f"ssd_scan_varlen: block and block_t must be at most the chunk ({chunk}) and "
            f"block_p at least 16, got {cfg}"
        )
    return cfg


def _dot_config(dtype: torch.dtype) -> dict[str, Any]:
    """Dtypes and precisions of the dots for `dtype` inputs.

    16-bit inputs: 16-bit dot operands, float32 accumulate; the chained state is float32
    throughout and enters the C.S dot rounded to bf16 for bf16 inputs, but stays float32
    for fp16 (fp16's range is too small for states). float32 inputs: float32 everywhere,
    IEEE dots.
    """
    if dtype == torch.float32 or interpret_mode():
        # The interpreter mis-computes 16-bit tl.dot; float32 there is also more exact.
        return dict(dot=tl.float32, precision="ieee", state_dot=tl.float32, state_precision="ieee")
    if dtype == torch.bfloat16:
        return dict(
            dot=tl.bfloat16, precision="tf32", state_dot=tl.bfloat16, state_precision="tf32"
        )
    return dict(dot=tl.float16, precision="tf32", state_dot=tl.float32, state_precision="tf32")


# Sequences per step of the chunk-metadata kernel's walk over them: one step for batches
# of up to 64 sequences, a few for the largest.
_CUMSUM_BLOCK_SEQ = 64


def _chunk_layout(
    dt: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    start_positions: torch.Tensor | None,
    chunk: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    snapshots: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (
        None,
        None,
        None,
    ),
) -> dict[str, torch.Tensor]:
    """Chunks of the packed sequences, on the device (launch 1 of the scan).

    Returns chunk_start, chunk_len, chunk_seq ([num_chunk_ids] int32; ids past the real
    chunks have chunk_seq -1), seq_first_chunk ([S + 1] int32: sequence s owns chunk ids
    seq_first_chunk[s]:seq_first_chunk[s + 1]), and dt (processed) and cum (its
    chunk-local cumsum of dt * A * log2(e): decays are exp2 of differences), both
    [num_chunk_ids, H, chunk] float32, zero dt past a chunk's end. With snapshots
    (seqs, lens, rows; at least one), also snapshot_row ([num_chunk_ids] int32): the
    state row each chunk's end state goes to (-1: none), made in the same launch.
    """
    T, H = dt.shape
    S = cu_seqlens.shape[0] - 1
    # Whole chunks, plus per sequence at most one partial or empty chunk, and one more
    # where its first chunk is shortened to align the rest.
    num_chunk_ids = cdiv(T, chunk) + (2 * S if start_positions is not None else S)
    dev = dt.device
    meta = torch.empty(3, num_chunk_ids, dtype=torch.int32, device=dev)
    seq_first_chunk = torch.empty(S + 1, dtype=torch.int32, device=dev)
    dt_buf = torch.empty(num_chunk_ids, H, chunk, dtype=torch.float32, device=dev)
    cum_buf = torch.empty_like(dt_buf)
    lo, hi = dt_limit
    block_h = min(16, next_pow2(H))
    snap_seqs, snap_lens, snap_rows = snapshots
    num_snapshots = snap_seqs.shape[0] if snap_seqs is not None else 0
    snapshot_row = None
    if num_snapshots:
        snapshot_row = torch.empty(num_chunk_ids, dtype=torch.int32, device=dev)
    _ssd_chunk_cumsum_kernel[(num_chunk_ids, cdiv(H, block_h))](
        dt,
        A,
        dt_bias,
        cu_seqlens,
        start_positions,
        dt_buf,
        cum_buf,
        meta[0],
        meta[1],
        meta[2],
        seq_first_chunk,
        snap_seqs if num_snapshots else None,
        snap_lens if num_snapshots else None,
        snap_rows if num_snapshots else None,
        snapshot_row,
        S,
        num_snapshots,
        H,
        float(lo),
        float(hi),
        *dt.stride(),
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus,
        CLAMP_DT=lo > 0.0 or hi < math.inf,
        HAS_START_POS=start_positions is not None,
        HAS_SNAPSHOTS=num_snapshots > 0,
        CHUNK=chunk,
        BLOCK_H=block_h,
        BLOCK_SEQ=_CUMSUM_BLOCK_SEQ,
    )
    layout = dict(
        chunk_start=meta[0],
        chunk_len=meta[1],
        chunk_seq=meta[2],
        seq_first_chunk=seq_first_chunk,
        dt=dt_buf,
        cum=cum_buf,
    )
    if snapshot_row is not None:
        layout["snapshot_row"] = snapshot_row
    return layout


def _prepare(
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
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    z: torch.Tensor | None,
    chunk_size: int,
    start_positions: torch.Tensor | None,
    snapshots: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (
        None,
        None,
        None,
    ),
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor] | None]:
    """Check the arguments and run launch 1 (`_chunk_layout`), as both kernel paths start.

    Returns y (empty, x's shape and dtype), the chunk, and the layout (None when there are
    no sequences: nothing to launch). With snapshots, the layout's "snapshot_row" maps
    each chunk id to the state row its end state goes to (-1: none).
    """
    _check_ssd_args(
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
        start_positions,
        snapshots,
    )
    y = torch.empty_like(x)
    chunk = chunk_tokens(chunk_size)
    if state_slots.shape[0] == 0:
        return y, chunk, None
    layout = _chunk_layout(
        dt, A, dt_bias, cu_seqlens, start_positions, chunk, dt_softplus, dt_limit, snapshots
    )
    return y, chunk, layout


def _scan_chunks(
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
    chunk: int,
    cfg: dict[str, Any],
) -> None:
    """Launches 2 and 3 of the Triton-language scan, after `_chunk_layout` (launch 1)."""
    H, P = x.shape[1:]
    G, N = B.shape[1:]
    dots = _dot_config(x.dtype)
    block, block_t = cfg["block"], cfg["block_t"]
    block_p = max(16, min(cfg["block_p"], next_pow2(P)))
    p_blocks = cdiv(P, block_p)
    block_n = max(16, next_pow2(N))
    num_chunk_ids = layout["chunk_len"].shape[0]
    dev = x.device
    rows = chunk // block
    cb = torch.empty(num_chunk_ids, G, rows, rows, block, block, dtype=x.dtype, device=dev)
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if cfg["maxnreg"] is not None:
        launch["maxnreg"] = cfg["maxnreg"]
    _ssd_chunk_cb_kernel[(rows * rows, num_chunk_ids, G)](
        B,
        C,
        cb,
        layout["chunk_start"],
        layout["chunk_len"],
        N,
        *B.stride(),
        *C.stride(),
        CHUNK=chunk,
        BLOCK=block,
        BLOCK_N=block_n,
        DOT_DTYPE=dots["dot"],
        DOT_PRECISION=dots["precision"],
        **launch,
    )
    ring = torch.empty(2, H * p_blocks, block_n, block_p, dtype=torch.float32, device=dev)
    # [ticket, published per (head, P block)]: the only buffer that must start at zero.
    counters = torch.zeros(1 + H * p_blocks, dtype=torch.int32, device=dev)
    z_strides = z.stride() if z is not None else (0, 0, 0)
    _ssd_chunk_scan_kernel[(num_chunk_ids * H * p_blocks,)](
        x,
        B,
        C,
        z,
        D,
        y,
        cb,
        layout["dt"],
        layout["cum"],
        layout["chunk_start"],
        layout["chunk_len"],
        layout["chunk_seq"],
        layout["seq_first_chunk"],
        state_slots,
        as_int8(has_initial_state),
        ssm_state,
        layout.get("snapshot_row"),
        ring,
        counters,
        counters[1:],
        H,
        H // G,
        P,
        N,
        *x.stride(),
        *B.stride(),
        *C.stride(),
        *z_strides,
        *y.stride(),
        *ssm_state.stride(),
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_SNAPSHOTS="snapshot_row" in layout,
        CHUNK=chunk,
        BLOCK=block,
        BLOCK_T=block_t,
        BLOCK_P=block_p,
        P_BLOCKS=p_blocks,
        BLOCK_N=block_n,
        DOT_DTYPE=dots["dot"],
        DOT_PRECISION=dots["precision"],
        STATE_DOT_DTYPE=dots["state_dot"],
        STATE_PRECISION=dots["state_precision"],
        **launch,
    )


def ssd_scan_varlen_triton(
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
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `ssd_scan_varlen_ref` (same arguments, shapes and result).

    Chunked (see the comment above the kernels): chunks of `chunk_tokens(chunk_size)`
    tokens, aligned to multiples of that in absolute positions (`start_positions`, as in
    the twin); blocking only affects rounding. Scratch: dt and its cumsum (8 bytes per
    token and head), C.B^T per chunk and group, and a float32 ring of two states per head
    (8 MiB at Bamba-9B dims). No host sync (CUDA-graph safe): chunk metadata is computed
    on the device. cu_seqlens, state_slots and has_initial_state values are not
    validated: slots must be valid and distinct. Snapshots must end on chunk boundaries
    (see the twin; not validated either): the program of the chunk a snapshot ends
    stores its end state there too. `config` overrides launch parameters (see
    `scan_launch_config`; benchmarks and tests only). This is the portable kernel;
    ssd_scan_hopper.ssd_scan_varlen_hopper is the sm_90 one.
    """
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
    cfg = scan_launch_config(x.dtype, chunk, config)
    if layout is not None:
        _scan_chunks(
            x, B, C, z, D, y, layout, ssm_state, state_slots, has_initial_state, chunk, cfg
        )
    return y
