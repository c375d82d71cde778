"""Mamba2 prefill: variable-length SSD (state space duality) chunked scan.

Per head h (group g = h // (H // G)), for each token t of a sequence:

    dt_t  = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S_t   = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)      S: [P, N]
    y_t   = S_t @ C_t + D * x_t;   y_t *= silu(z_t) if z is given

S_{-1} is the sequence's slot state if has_initial_state else zeros; the final S is
written back to the slot. The chunked form (used by both twin and kernels) computes,
per chunk of L tokens with cum_i = sum_{k<=i} dt_k A:

    y_i = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) (S_in @ C_i)
    S_out = exp(cum_L) S_in + sum_j exp(cum_L - cum_j) dt_j outer(x_j, B_j)

The twin walks the chunks in order; the Triton kernels compute the second sum of S_out
for all chunks in parallel, chain only the states, then compute y for all chunks in
parallel (see the comment above the kernels).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    check_shape,
    check_varlen,
    interpret_mode,
    lazy_jit,
    next_pow2,
    prev_pow2,
    process_dt,
    tl,
    triton,
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
    check_shape("state_slots", state_slots, [None])
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
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

    Returns:
        y: [T, H, P] in x.dtype.
    """
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
    )
    seqs = check_varlen(cu_seqlens, state_slots, has_initial_state, T, ssm_state.shape[0])
    heads_per_group = H // G
    dt_all = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    A_gh = A.float().view(G, heads_per_group)
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    for start, end, slot, has_init in seqs:
        if has_init:
            state = ssm_state[slot].float().view(G, heads_per_group, P, N)
        else:
            state = x.new_zeros(G, heads_per_group, P, N, dtype=torch.float32)
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
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
        ssm_state[slot] = state.reshape(H, P, N).to(ssm_state.dtype)
    if D is not None:
        y += D.float()[:, None] * x.float()
    if z is not None:
        y *= F.silu(z.float())
    return y.to(x.dtype)


# ---------------------------------------------------------------------------- Triton
#
# The Triton path is the chunk-parallel SSD decomposition, five launches, no host sync:
#   1. _ssd_chunk_cumsum_kernel: chunk metadata from cu_seqlens (chunks restart at each
#      sequence's first token), processed dt and its chunk-local cumsum of dt*A.
#   2. _ssd_chunk_cb_kernel: C_i . B_j per (chunk, group), shared by the group's heads.
#   3. _ssd_chunk_state_kernel: each chunk's own end-state contribution (zero state in),
#      all chunks in parallel, into a float32 [chunk, H, P, N] buffer.
#   4. _ssd_state_passing_kernel: per sequence, the only sequential pass, over state-sized
#      data: S_k = exp(sum dA_k) S_{k-1} + contribution_k, from the slot state or zeros;
#      writes the state entering each chunk and the final state into the slot.
#   5. _ssd_chunk_output_kernel: per chunk and block of rows, all in parallel:
#      y = (C B^T * decay * dt) x + exp(cum) C S_in + D x, gated by silu(z).
# Chunk ids run over an upper bound, cdiv(T, chunk) + S - 1, so grids and buffers never
# depend on device values; ids past the real chunks have length 0 and do nothing.


@lazy_jit
def _ssd_chunk_cumsum_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, cu_seqlens_ptr,
    dt_out_ptr, cum_out_ptr, chunk_start_ptr, chunk_len_ptr, seq_first_chunk_ptr,
    num_seqs, H, dt_min, dt_max,
    stride_dt_t, stride_dt_h,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, CLAMP_DT: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SEQ: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    pid_h = tl.program_id(1)
    # Which sequence owns this chunk id, without a search: sequence s owns chunk ids
    # [first_chunk[s], first_chunk[s] + cdiv(len_s, CHUNK)); at most one lane matches.
    offs_s = tl.arange(0, BLOCK_SEQ)
    mask_s = offs_s < num_seqs
    seq_start = tl.load(cu_seqlens_ptr + offs_s, mask=mask_s, other=0).to(tl.int32)
    seq_end = tl.load(cu_seqlens_ptr + offs_s + 1, mask=mask_s, other=0).to(tl.int32)
    num_chunks = (seq_end - seq_start + CHUNK - 1) // CHUNK
    last_chunk = tl.cumsum(num_chunks, 0)
    first_chunk = last_chunk - num_chunks
    owner = (first_chunk <= chunk) & (chunk < last_chunk)
    start = tl.sum(tl.where(owner, seq_start + (chunk - first_chunk) * CHUNK, 0), 0)
    end = tl.sum(tl.where(owner, seq_end, 0), 0)
    length = tl.minimum(end - start, CHUNK)
    tl.store(chunk_start_ptr + chunk, start, mask=pid_h == 0)
    tl.store(chunk_len_ptr + chunk, length, mask=pid_h == 0)
    first_program = (chunk == 0) & (pid_h == 0)
    tl.store(seq_first_chunk_ptr + offs_s, first_chunk, mask=mask_s & first_program)
    tl.store(seq_first_chunk_ptr + num_seqs, tl.sum(num_chunks, 0), mask=first_program)

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
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    cum = tl.cumsum(dt * A[None, :], 0)
    out = (chunk.to(tl.int64) * H + offs_h[None, :]) * CHUNK + offs_l[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask_h[None, :])
    tl.store(cum_out_ptr + out, cum, mask=mask_h[None, :])


@lazy_jit
def _ssd_chunk_cb_kernel(
    B_ptr, C_ptr, cb_ptr, chunk_start_ptr, chunk_len_ptr, N,
    stride_b_t, stride_b_g, stride_b_n,
    stride_c_t, stride_c_g, stride_c_n,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    group = tl.program_id(2)
    num_groups = tl.num_programs(2)
    length = tl.load(chunk_len_ptr + chunk)
    t0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    offs_m = (tile // (CHUNK // BLOCK_K)) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = (tile % (CHUNK // BLOCK_K)) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    c = tl.load(
        C_ptr + (t0 + offs_m)[:, None] * stride_c_t + group * stride_c_g
        + offs_n[None, :] * stride_c_n,
        mask=(offs_m < length)[:, None] & mask_n[None, :], other=0.0,
    )  # fmt: skip
    bT = tl.load(
        B_ptr + (t0 + offs_k)[None, :] * stride_b_t + group * stride_b_g
        + offs_n[:, None] * stride_b_n,
        mask=(offs_k < length)[None, :] & mask_n[:, None], other=0.0,
    )  # fmt: skip
    cb = tl.dot(c.to(DOT_DTYPE), bT.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    out = (chunk * num_groups + group) * CHUNK * CHUNK + offs_m[:, None] * CHUNK + offs_k[None, :]
    # Ids past the real chunks are never read: skip their stores.
    tl.store(cb_ptr + out, cb.to(cb_ptr.dtype.element_ty), mask=length > 0)


@lazy_jit
def _ssd_chunk_state_kernel(
    x_ptr, B_ptr, dt_buf_ptr, cum_buf_ptr, contrib_ptr, chunk_start_ptr, chunk_len_ptr,
    heads_per_group, P, N,
    stride_x_t, stride_x_h, stride_x_p,
    stride_b_t, stride_b_g, stride_b_n,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # contribution = sum_j exp(cum_last - cum_j) dt_j outer(x_j, B_j): the chunk's end
    # state from a zero state; a [P, K] x [K, N] dot per block of K tokens.
    head = tl.program_id(0)
    chunk = tl.program_id(1).to(tl.int64)
    H = tl.num_programs(0)
    group = head // heads_per_group
    length = tl.load(chunk_len_ptr + chunk)
    t0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    base = (chunk * H + head) * CHUNK
    total = tl.load(cum_buf_ptr + base + CHUNK - 1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    # NOTE: a constexpr trip count (masked past the end) keeps the wgmma pipelined; with
    # `length` as the bound ptxas serialises the dots (warning C7515 on sm_90).
    for k0 in range(0, CHUNK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < length
        t = t0 + offs_k
        cum = tl.load(cum_buf_ptr + base + offs_k)
        dt = tl.load(dt_buf_ptr + base + offs_k)
        # NOTE: cum is non-increasing (A < 0, dt >= 0), so total - cum <= 0: no overflow.
        weight = tl.exp(total - cum) * dt
        # Scale x (the [P, K] operand), not B ([K, N], the larger one): B then goes from
        # memory to the dot unchanged.
        xT = tl.load(
            x_ptr + t[None, :] * stride_x_t + head * stride_x_h + offs_p[:, None] * stride_x_p,
            mask=mask_k[None, :] & mask_p[:, None], other=0.0,
        ).to(tl.float32)  # fmt: skip
        b = tl.load(
            B_ptr + t[:, None] * stride_b_t + group * stride_b_g + offs_n[None, :] * stride_b_n,
            mask=mask_k[:, None] & mask_n[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(
            (xT * weight[None, :]).to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )  # fmt: skip
    out = (chunk * H + head) * P * N + offs_p[:, None] * N + offs_n[None, :]
    mask_pn = mask_p[:, None] & mask_n[None, :]
    tl.store(contrib_ptr + out, acc, mask=mask_pn & (length > 0))


@lazy_jit
def _ssd_state_passing_kernel(
    contrib_ptr, cum_buf_ptr, states_in_ptr, state_ptr,
    seq_first_chunk_ptr, state_slots_ptr, has_init_ptr,
    P, N,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program carries BLOCK elements of one (sequence, head) state through the
    # sequence's chunks; the only sequential loop, over state-sized data only.
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    H = tl.num_programs(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P * N
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    slot_ptrs = (
        state_ptr + slot * stride_s_slot + head * stride_s_h
        + (offs // N) * stride_s_p + (offs % N) * stride_s_n
    )  # fmt: skip
    state = tl.load(slot_ptrs, mask=mask & has_init, other=0.0).to(tl.float32)
    first = tl.load(seq_first_chunk_ptr + seq).to(tl.int64)
    last = tl.load(seq_first_chunk_ptr + seq + 1).to(tl.int64)
    head_offs = head * P * N + offs
    # Load one chunk ahead: the loads do not depend on the carried state, so the next
    # contribution is in flight while this one is applied.
    contrib = tl.load(contrib_ptr + first * H * P * N + head_offs, mask=mask & (first < last))
    for k in range(first, last):
        current = contrib
        contrib = tl.load(
            contrib_ptr + (k + 1) * H * P * N + head_offs, mask=mask & (k + 1 < last)
        )  # fmt: skip
        total = tl.load(cum_buf_ptr + (k * H + head) * CHUNK + CHUNK - 1)
        tl.store(
            states_in_ptr + k * H * P * N + head_offs,
            state.to(states_in_ptr.dtype.element_ty), mask=mask,
        )  # fmt: skip
        state = state * tl.exp(total) + current
    tl.store(slot_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)


@lazy_jit
def _ssd_chunk_output_kernel(
    x_ptr, C_ptr, z_ptr, D_ptr, y_ptr, cb_ptr, dt_buf_ptr, cum_buf_ptr, states_in_ptr,
    chunk_start_ptr, chunk_len_ptr,
    heads_per_group, P, N,
    stride_x_t, stride_x_h, stride_x_p,
    stride_c_t, stride_c_g, stride_c_n,
    stride_z_t, stride_z_h, stride_z_p,
    stride_y_t, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STATE_DOT_DTYPE: tl.constexpr, STATE_PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    block_m = tl.program_id(1)
    chunk = tl.program_id(2).to(tl.int64)
    H = tl.num_programs(0)
    group = head // heads_per_group
    length = tl.load(chunk_len_ptr + chunk)
    m0 = block_m * BLOCK_M
    if m0 < length:
        t0 = tl.load(chunk_start_ptr + chunk).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = offs_m < length
        mask_p = offs_p < P
        mask_n = offs_n < N
        mask_mp = mask_m[:, None] & mask_p[None, :]
        base = (chunk * H + head) * CHUNK
        cum_m = tl.load(cum_buf_ptr + base + offs_m)

        # Inter-chunk: y_i = exp(cum_i) C_i . S_in.
        c = tl.load(
            C_ptr + (t0 + offs_m)[:, None] * stride_c_t + group * stride_c_g
            + offs_n[None, :] * stride_c_n,
            mask=mask_m[:, None] & mask_n[None, :], other=0.0,
        )  # fmt: skip
        state_inT = tl.load(
            states_in_ptr + (chunk * H + head) * P * N + offs_p[None, :] * N + offs_n[:, None],
            mask=mask_p[None, :] & mask_n[:, None], other=0.0,
        )  # fmt: skip
        acc = tl.dot(
            c.to(STATE_DOT_DTYPE), state_inT.to(STATE_DOT_DTYPE), input_precision=STATE_PRECISION
        )  # fmt: skip
        acc *= tl.exp(cum_m)[:, None]

        # Intra-chunk: y_i += sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j.
        num_groups = H // heads_per_group
        cb_base = (chunk * num_groups + group) * CHUNK * CHUNK
        for k0 in range(0, tl.minimum(m0 + BLOCK_M, length), BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            cb = tl.load(cb_ptr + cb_base + offs_m[:, None] * CHUNK + offs_k[None, :])
            cum_k = tl.load(cum_buf_ptr + base + offs_k)
            dt_k = tl.load(dt_buf_ptr + base + offs_k)
            x_k = tl.load(
                x_ptr + (t0 + offs_k)[:, None] * stride_x_t + head * stride_x_h
                + offs_p[None, :] * stride_x_p,
                mask=(offs_k < length)[:, None] & mask_p[None, :], other=0.0,
            )  # fmt: skip
            causal = offs_m[:, None] >= offs_k[None, :]
            # -inf above the diagonal before exp: cum_i - cum_j > 0 there and may overflow.
            decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_k[None, :], -float("inf")))
            scores = tl.where(causal, cb.to(tl.float32) * decay, 0.0) * dt_k[None, :]
            acc += tl.dot(
                scores.to(DOT_DTYPE), x_k.to(DOT_DTYPE), input_precision=DOT_PRECISION
            )  # fmt: skip

        t_m = t0 + offs_m
        if HAS_D:
            x_m = tl.load(
                x_ptr + t_m[:, None] * stride_x_t + head * stride_x_h
                + offs_p[None, :] * stride_x_p,
                mask=mask_mp, other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc += tl.load(D_ptr + head).to(tl.float32) * x_m
        if HAS_Z:
            z = tl.load(
                z_ptr + t_m[:, None] * stride_z_t + head * stride_z_h
                + offs_p[None, :] * stride_z_p,
                mask=mask_mp, other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc *= z / (1.0 + tl.exp(-z))
        tl.store(
            y_ptr + t_m[:, None] * stride_y_t + head * stride_y_h + offs_p[None, :] * stride_y_p,
            acc.to(y_ptr.dtype.element_ty), mask=mask_mp,
        )  # fmt: skip


def _launch_config(
    x: torch.Tensor, S: int, H: int, P: int, N: int, chunk_size: int
) -> dict[str, Any]:
    """Block sizes and launch options (benchmarks/kernels/bench_ssd.py sweeps these).

    chunk: tokens per chunk (chunk_size rounded down to a power of two, 16..256). Larger
        chunks cut the per-chunk state traffic (a float32 contribution and an entering
        state per chunk and head: 4 MiB + 2 MiB at Bamba-9B dims, about the bytes of 256
        tokens of x) at the price of more intra-chunk dot work.
    block_m, block_k: rows and columns of the output kernel's tiles (and of the C.B^T
        tiles); block_k also blocks the tokens of the chunk-state kernel.
    state_block: state elements per program of the sequential state pass.
    """
    chunk = max(16, min(256, prev_pow2(chunk_size)))
    return {
        "chunk": chunk,
        "block_m": min(64, chunk),
        "block_k": min(64, chunk),
        "state_block": 512,
        "num_warps": 4,
        "num_stages": 2,
    }


def _dot_config(dtype: torch.dtype) -> dict[str, Any]:
    """Dtypes and precisions of the dots and of the entering-state buffer for `dtype` inputs.

    16-bit inputs: 16-bit dot operands, float32 accumulate. The carried state stays float32
    in the state pass; for bf16 inputs the per-chunk entering states are stored in bf16
    (they are only a C.S dot operand, and this halves their traffic), for fp16 in float32
    (fp16's range is too small for states). float32 inputs: float32 everywhere, IEEE dots.
    """
    states_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if dtype == torch.float32 or interpret_mode():
        # The interpreter mis-computes 16-bit tl.dot; float32 there is also more exact.
        return dict(dot=tl.float32, precision="ieee", states_dtype=states_dtype,
                    state_dot=tl.float32, state_precision="ieee")  # fmt: skip
    if dtype == torch.bfloat16:
        return dict(dot=tl.bfloat16, precision="tf32", states_dtype=states_dtype,
                    state_dot=tl.bfloat16, state_precision="tf32")  # fmt: skip
    return dict(dot=tl.float16, precision="tf32", states_dtype=states_dtype,
                state_dot=tl.float32, state_precision="tf32")  # fmt: skip


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
) -> torch.Tensor:
    """Triton twin of `ssd_scan_varlen_ref` (same arguments, shapes and result).

    Chunk-parallel (see the comment above the kernels): chunks of chunk_size tokens
    rounded down to a power of two in [16, 256], restarting at each sequence's first
    token; blocking only affects rounding. Scratch buffers take about
    (T / chunk + S) * H * P * N * 6 bytes for bf16 inputs (4 for float32/fp16), e.g.
    0.8 GB at 32k tokens of Bamba-9B. No host sync (CUDA-graph safe): chunk metadata is
    computed on the device. cu_seqlens, state_slots and has_initial_state values are not
    validated: slots must be valid and distinct.
    """
    T, H, P, G, N = _check_ssd_args(
        x, dt, A, B, C, D, cu_seqlens, ssm_state, state_slots, has_initial_state, dt_bias, z,
        chunk_size,
    )  # fmt: skip
    S = state_slots.shape[0]
    check_shape("cu_seqlens", cu_seqlens, [S + 1])
    check_shape("has_initial_state", has_initial_state, [S])
    y = torch.empty_like(x)
    if S == 0:
        return y
    cfg = _launch_config(x, S, H, P, N, chunk_size)
    dots = _dot_config(x.dtype)
    chunk, block_m, block_k = cfg["chunk"], cfg["block_m"], cfg["block_k"]
    block_p, block_n = max(16, next_pow2(P)), max(16, next_pow2(N))
    # Every sequence adds at most one partial chunk beyond the whole ones.
    num_chunk_ids = max(1, triton.cdiv(T, chunk) + S - 1)
    dev = x.device
    chunk_start = torch.empty(num_chunk_ids, dtype=torch.int32, device=dev)
    chunk_len = torch.empty(num_chunk_ids, dtype=torch.int32, device=dev)
    seq_first_chunk = torch.empty(S + 1, dtype=torch.int32, device=dev)
    dt_buf = torch.empty(num_chunk_ids, H, chunk, dtype=torch.float32, device=dev)
    cum_buf = torch.empty_like(dt_buf)
    cb = torch.empty(num_chunk_ids, G, chunk, chunk, dtype=x.dtype, device=dev)
    contrib = torch.empty(num_chunk_ids, H, P, N, dtype=torch.float32, device=dev)
    # NOTE: with float32 entering states the state pass overwrites each contribution
    # with the entering state in place (it reads a chunk's entry before writing it).
    states_in = (
        contrib
        if dots["states_dtype"] == torch.float32
        else torch.empty(num_chunk_ids, H, P, N, dtype=dots["states_dtype"], device=dev)
    )
    lo, hi = dt_limit
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}

    block_h = min(16, next_pow2(H))
    _ssd_chunk_cumsum_kernel[(num_chunk_ids, triton.cdiv(H, block_h))](
        dt, A, dt_bias, cu_seqlens,
        dt_buf, cum_buf, chunk_start, chunk_len, seq_first_chunk,
        S, H, float(lo), float(hi), *dt.stride(),
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        CLAMP_DT=lo > 0.0 or hi < math.inf,
        CHUNK=chunk, BLOCK_H=block_h, BLOCK_SEQ=next_pow2(S + 1),
    )  # fmt: skip
    _ssd_chunk_cb_kernel[((chunk // block_m) * (chunk // block_k), num_chunk_ids, G)](
        B, C, cb, chunk_start, chunk_len, N, *B.stride(), *C.stride(),
        CHUNK=chunk, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n,
        DOT_DTYPE=dots["dot"], DOT_PRECISION=dots["precision"], **launch,
    )  # fmt: skip
    _ssd_chunk_state_kernel[(H, num_chunk_ids)](
        x, B, dt_buf, cum_buf, contrib, chunk_start, chunk_len,
        H // G, P, N, *x.stride(), *B.stride(),
        CHUNK=chunk, BLOCK_K=block_k, BLOCK_P=block_p, BLOCK_N=block_n,
        DOT_DTYPE=dots["dot"], DOT_PRECISION=dots["precision"], **launch,
    )  # fmt: skip
    state_block = min(cfg["state_block"], next_pow2(P * N))
    _ssd_state_passing_kernel[(triton.cdiv(P * N, state_block), H, S)](
        contrib, cum_buf, states_in, ssm_state,
        seq_first_chunk, state_slots, has_initial_state.to(torch.int8),
        P, N, *ssm_state.stride(),
        CHUNK=chunk, BLOCK=state_block, num_warps=4,
    )  # fmt: skip
    z_strides = z.stride() if z is not None else (0, 0, 0)
    _ssd_chunk_output_kernel[(H, chunk // block_m, num_chunk_ids)](
        x, C, z, D, y, cb, dt_buf, cum_buf, states_in, chunk_start, chunk_len,
        H // G, P, N, *x.stride(), *C.stride(), *z_strides, *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None,
        CHUNK=chunk, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_P=block_p, BLOCK_N=block_n,
        DOT_DTYPE=dots["dot"], DOT_PRECISION=dots["precision"],
        STATE_DOT_DTYPE=dots["state_dot"], STATE_PRECISION=dots["state_precision"], **launch,
    )  # fmt: skip
    return y
