"""Fused mixture-of-experts MLP over routed tokens.

Each token t goes to `top_k` experts (topk_ids[t]) with weights (topk_weights[t]); its
output is sum_k weight[t, k] * expert_k(x[t]), where an expert is

    gated:      down(act(gate(x)) * up(x))      w13 = [gate; up] stacked: [E, 2I, H]
    non-gated:  down(act(up(x)))                w13 = up: [E, I, H]

and down is w2 [E, H, I]. Under tensor parallelism I is this rank's share of each
expert's intermediate dim and the result is a partial sum (the caller all-reduces).

The Triton path sorts the (token, k) assignments by expert on the device (a sort and a
few cumulative sums, no host sync, shapes fixed by T, K and E so CUDA graphs replay it)
into blocks of BLOCK_M rows that all belong to one expert, then runs two grouped GEMMs:
gate/up with the activation and gating fused, and down with the routing weight fused.
The K output rows of a token are summed in a fixed order, with no atomics: results are
the same run to run, and within a launch configuration a token's result does not depend
on which other tokens share its expert's blocks.

`moe_route` is the router's top-k in one launch: softmax or sigmoid scores, an optional
correction bias that moves the choice, grouped top-k, renormalisation and scaling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    check_shape,
    device_function,
    interpret_mode,
    launch_config,
    lazy_jit,
    next_pow2,
    tl,
)

# Expert activations: name -> the Triton kernels' code.
ACTIVATIONS = {"silu": 0, "gelu": 1, "relu2": 2}
SCORING = ("softmax", "sigmoid")


def _act_ref(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(h)
    if activation == "gelu":
        return F.gelu(h)
    return torch.relu(h).square()


def _check_moe_args(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    gated: bool,
) -> tuple[int, int, int, int, int]:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"expert activation {activation!r} is not supported; use one of "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    check_shape("x", x, [None, None])
    T, H = x.shape
    check_shape("w13", w13, [None, None, H])
    E = w13.shape[0]
    if gated and w13.shape[1] % 2:
        raise ValueError(
            f"gated experts stack gate and up: w13 needs an even dim 1, got {w13.shape}"
        )
    I = w13.shape[1] // 2 if gated else w13.shape[1]  # noqa: E741
    check_shape("w2", w2, [E, H, I])
    check_shape("topk_ids", topk_ids, [T, None])
    K = topk_ids.shape[1]
    check_shape("topk_weights", topk_weights, [T, K])
    return T, H, E, I, K


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    gated: bool = True,
) -> torch.Tensor:
    """Routed expert MLPs in PyTorch: the reference the Triton kernel is tested against.

    Each expert's projections run in x.dtype over the tokens routed to it (as
    transformers does); the weighted per-assignment outputs are summed over k in float32.

    Args:
        x: [T, H]. w13: [E, 2I, H] (gate rows, then up rows) if gated, else [E, I, H].
        w2: [E, H, I]. topk_weights: [T, K] (float32). topk_ids: [T, K] expert ids.
        activation: "silu", "gelu" or "relu2" (squared ReLU).

    Returns:
        [T, H] in x.dtype.
    """
    T, H, E, I, K = _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, gated)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    out = torch.zeros(T * K, H, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        h = F.linear(x[rows // K], w13[expert])
        if gated:
            gate, up = h.split(I, dim=-1)
            h = _act_ref(gate, activation) * up
        else:
            h = _act_ref(h, activation)
        y = F.linear(h, w2[expert]).float()
        out[rows] = y * topk_weights.reshape(-1)[rows, None].float()
    return out.view(T, K, H).sum(1).to(x.dtype)


def _check_route_args(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    num_groups: int,
    topk_groups: int,
) -> tuple[int, int]:
    check_shape("logits", logits, [None, None])
    T, E = logits.shape
    if scoring not in SCORING:
        raise ValueError(f"router scoring {scoring!r} is not supported; use one of {SCORING}")
    if correction_bias is not None:
        check_shape("correction_bias", correction_bias, [E])
    if num_groups < 1 or E % num_groups or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"{E} experts cannot form {num_groups} groups with {topk_groups} of them kept"
        )
    if not 1 <= top_k <= topk_groups * (E // num_groups):
        raise ValueError(
            f"top_k = {top_k} must lie in [1, {topk_groups * (E // num_groups)}] (the experts "
            "of the groups kept)"
        )
    return T, E


def moe_route_ref(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None = None,
    *,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their weights (PyTorch twin of `moe_route_triton`).

    Scores are the softmax or sigmoid of the logits, in float32. `correction_bias` [E] is
    added to the scores to choose experts; the weights stay the uncorrected scores. With
    `num_groups` > 1, only the `topk_groups` groups whose two best experts score the most
    (DeepSeek-V3's rule) are chosen from. Weights are renormalised over the chosen
    experts if asked, then times `routed_scaling_factor`.

    Args:
        logits: [T, E] router logits.

    Returns:
        weights [T, top_k] float32 and ids [T, top_k] int64, best first.
    """
    _check_route_args(logits, correction_bias, top_k, scoring, num_groups, topk_groups)
    logits = logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        T, E = choice.shape
        groups = choice.view(T, num_groups, E // num_groups)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)
        kept = group_scores.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = groups.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


# ---------------------------------------------------------------------------- Triton


@device_function
def _activate(h, ACTIVATION: tl.constexpr):
    """silu (0), gelu (1) or squared ReLU (2) of a float32 tile."""
    if ACTIVATION == 0:
        return h / (1.0 + tl.exp(-h))
    if ACTIVATION == 1:
        return 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    h = tl.maximum(h, 0.0)
    return h * h


@lazy_jit
def _moe_route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    per_group,
    stride_l_t,
    stride_l_e,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
):
    """One token's routing. The experts sit in a [group, expert in group] tile (one group
    when ungrouped); top-k is TOP_K rounds of argmax, best first, lowest id on ties."""
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_p = tl.arange(0, BLOCK_P)
    experts = offs_g[:, None] * per_group + offs_p[None, :]
    ok = (offs_g[:, None] < NUM_GROUPS) & (offs_p[None, :] < per_group)
    logit = tl.load(
        logits_ptr + t * stride_l_t + experts * stride_l_e, mask=ok, other=float("-inf")
    ).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logit))
    else:
        e = tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if NUM_GROUPS > 1:
        # A group's score is the sum of its two best experts; keep the TOPK_GROUPS best.
        best = tl.argmax(choice, axis=1)
        second = tl.where(offs_p[None, :] == best[:, None], float("-inf"), choice)
        group_score = tl.max(choice, axis=1) + tl.max(second, axis=1)
        keep = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            g = tl.argmax(group_score, axis=0)
            keep = tl.where(offs_g == g, 1, keep)
            group_score = tl.where(offs_g == g, float("-inf"), group_score)
        choice = tl.where(keep[:, None] == 1, choice, float("-inf"))
    flat_choice = tl.reshape(choice, [BLOCK_G * BLOCK_P])
    flat_scores = tl.reshape(scores, [BLOCK_G * BLOCK_P])
    flat_ids = tl.reshape(experts, [BLOCK_G * BLOCK_P])
    pos = tl.arange(0, BLOCK_G * BLOCK_P)
    offs_k = tl.arange(0, BLOCK_TOPK)
    chosen_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_TOPK], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        hit = pos == tl.argmax(flat_choice, axis=0)
        chosen_w = tl.where(offs_k == k, tl.sum(tl.where(hit, flat_scores, 0.0), axis=0), chosen_w)
        chosen_id = tl.where(offs_k == k, tl.sum(tl.where(hit, flat_ids, 0), axis=0), chosen_id)
        flat_choice = tl.where(hit, float("-inf"), flat_choice)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    chosen_w = chosen_w * routed_scaling_factor
    k_ok = offs_k < TOP_K
    tl.store(weights_ptr + t * TOP_K + offs_k, chosen_w, mask=k_ok)
    tl.store(ids_ptr + t * TOP_K + offs_k, chosen_id, mask=k_ok)


def moe_route_triton(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None = None,
    *,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `moe_route_ref` (same arguments and results), one program per
    token. Ties between experts go to the lower id (the twin's torch.topk leaves them
    unspecified; real router scores do not tie)."""
    T, E = _check_route_args(logits, correction_bias, top_k, scoring, num_groups, topk_groups)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    per_group = E // num_groups
    _moe_route_kernel[(T,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        weights,
        ids,
        per_group,
        *logits.stride(),
        float(routed_scaling_factor),
        TOP_K=top_k,
        SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize,
        NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups,
        BLOCK_G=next_pow2(num_groups),
        BLOCK_P=next_pow2(per_group),
        BLOCK_TOPK=next_pow2(top_k),
        num_warps=4 if E > 256 else 1,
    )
    return weights, ids


def align_by_expert_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the T*K assignments by expert into blocks of `block_m` rows, on the device
    (PyTorch ops: a stable sort, counts and cumulative sums, a search; about a dozen
    kernels). `align_by_expert` is its one-launch Triton twin.

    Returns:
        sorted_rows: [num_blocks * block_m] int32 assignment ids (t * K + k), expert by
            expert, each expert's run padded to a multiple of block_m with T*K (no row).
        block_expert: [num_blocks] int32 expert of each block; num_experts for blocks
            past the last expert's run (nothing to do).

    num_blocks = ceil(T*K / block_m) + min(E, T*K) bounds the blocks any routing needs,
    so the shapes depend only on T, K and E.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_rows, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    num_blocks = -(-num_rows // block_m) + min(num_experts, num_rows)
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True, out_int32=True)
    return sorted_rows, block_expert


# Most assignments (T * K) the one-launch alignment takes; each of its E programs reads
# them all, so past this the PyTorch ops (a sort) are cheaper.
ALIGN_MAX_ROWS = 4096


@lazy_jit(do_not_specialize=("num_rows", "num_blocks"))
def _align_kernel(
    ids_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_rows,
    num_blocks,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program e writes expert e's run: its assignments in row order (a stable sort),
    padded to whole blocks with `num_rows`, and its blocks' expert; program 0 also the
    blocks past the last run. Every program counts all experts first, for its offset."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, num_rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + offs_r, mask=offs_r < num_rows, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0), axis=0)
    mine = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    mine_padded = tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
    seen = 0
    for r0 in range(0, num_rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + offs_r, mask=offs_r < num_rows, other=-1).to(tl.int32)
        hit = (ids == e).to(tl.int32)
        dest = start + seen + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_rows_ptr + dest, offs_r, mask=hit == 1)
        seen += tl.sum(hit, axis=0)
    for j0 in range(0, mine_padded - mine, BLOCK_M):
        offs_j = mine + j0 + tl.arange(0, BLOCK_M)
        tl.store(sorted_rows_ptr + start + offs_j, num_rows, mask=offs_j < mine_padded)
    for b0 in range(0, mine_padded // BLOCK_M, BLOCK_R):
        offs_b = b0 + tl.arange(0, BLOCK_R)
        block = start // BLOCK_M + offs_b
        tl.store(block_expert_ptr + block, e, mask=offs_b < mine_padded // BLOCK_M)
    if e == 0:
        total = tl.sum(padded, axis=0)
        for b0 in range(total // BLOCK_M, num_blocks, BLOCK_R):
            offs_b = b0 + tl.arange(0, BLOCK_R)
            tl.store(block_expert_ptr + offs_b, num_experts, mask=offs_b < num_blocks)
        for j0 in range(total, num_blocks * BLOCK_M, BLOCK_R):
            offs_j = j0 + tl.arange(0, BLOCK_R)
            tl.store(sorted_rows_ptr + offs_j, num_rows, mask=offs_j < num_blocks * BLOCK_M)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert_ref`'s result (the same tensors, element for element) in one launch
    of E programs, up to ALIGN_MAX_ROWS assignments; more go through the PyTorch ops."""
    num_rows = topk_ids.numel()
    if num_rows > ALIGN_MAX_ROWS or num_rows == 0:
        return align_by_expert_ref(topk_ids, num_experts, block_m)
    num_blocks = -(-num_rows // block_m) + min(num_experts, num_rows)
    device = topk_ids.device
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _align_kernel[(num_experts,)](
        topk_ids.reshape(-1),
        sorted_rows,
        block_expert,
        num_rows,
        num_blocks,
        num_experts,
        BLOCK_M=block_m,
        BLOCK_R=max(16, 8192 // next_pow2(num_experts)),  # the count tile: 8k entries
        BLOCK_E=next_pow2(num_experts),
        num_warps=4,
    )
    return sorted_rows, block_expert


@lazy_jit(do_not_specialize=("num_rows",))
def _moe_up_kernel(
    x_ptr,
    w_ptr,
    inter_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_rows,
    top_k,
    hidden,
    inter_size,
    num_experts,
    stride_x_t,
    stride_x_h,
    stride_w_e,
    stride_w_n,
    stride_w_h,
    stride_i_r,
    stride_i_n,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """inter[row, n] = act(x[tok] . gate[e, n]) * (x[tok] . up[e, n]) for one block of rows
    of expert e and BLOCK_N intermediate channels."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_ok = rows < num_rows
    tokens = (rows // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x_t + offs_k[None, :] * stride_x_h
    w_ptrs = (
        w_ptr + expert * stride_w_e + offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_h
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wt = tl.load(w_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
        if GATED:
            wu = tl.load(w_ptrs + inter_size * stride_w_n, mask=w_mask, other=0.0).to(DOT_DTYPE)
            acc_up = tl.dot(xt, wu, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_x_h
        w_ptrs += BLOCK_K * stride_w_h
    h = _activate(acc, ACTIVATION)
    if GATED:
        h = h * acc_up
    out_ptrs = inter_ptr + rows[:, None].to(tl.int64) * stride_i_r + offs_n[None, :] * stride_i_n
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@lazy_jit(do_not_specialize=("num_rows",))
def _moe_down_kernel(
    inter_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    sorted_rows_ptr,
    block_expert_ptr,
    num_rows,
    hidden,
    inter_size,
    num_experts,
    stride_i_r,
    stride_i_n,
    stride_w_e,
    stride_w_h,
    stride_w_n,
    stride_o_r,
    stride_o_h,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[row, h] = weight[row] * (inter[row] . down[e, h]) for one block of rows of
    expert e and BLOCK_N hidden channels."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= num_experts:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_m)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + rows64[:, None] * stride_i_r + offs_k[None, :] * stride_i_n
    w_ptrs = (
        w_ptr + expert * stride_w_e + offs_n[None, :] * stride_w_h + offs_k[:, None] * stride_w_n
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = offs_k < inter_size - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        wt = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, wt, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_i_n
        w_ptrs += BLOCK_K * stride_w_n
    weight = tl.load(weights_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows64[:, None] * stride_o_r + offs_n[None, :] * stride_o_h
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])


# Defaults by the mean number of rows per expert (T*K / E), up to the first field:
# (block_m, block_n, block_k, num_warps, num_stages). Decode (a few rows per expert)
# streams weights through narrow tiles; prefill uses wide tiles. From the H200 sweep of
# benchmarks/kernels/bench_moe.py (moe_2026-12-02_h200.md): at 17-64 rows per expert
# (Jamba-Mini-1.7 at 256 tokens) 64-row blocks read each expert's weights once, 1.03x
# the floor against 1.18x with 32-row blocks.
_LAUNCH_TABLE: tuple[tuple[float, int, int, int, int, int], ...] = (
    (16, 16, 64, 128, 4, 3),
    (64, 64, 64, 64, 4, 3),
    (float("inf"), 64, 128, 64, 8, 3),
)


# Prefill over large experts (an intermediate size of at least this) fills 128-row blocks
# where each expert has at least 128 rows: at Jamba-Mini-1.7's experts (16 of 4096 x
# 14336, top-2) and 4,096 tokens 7.32 ms against 8.31 with 64-row blocks, while
# Granite-4.0-H-Tiny's (64 of 1536 x 512, top-6) took 1.20 against 0.87 (one H200,
# moe_2026-12-02_h200.md). Sizes between were not measured.
_LARGE_EXPERT = 4096


def moe_launch_config(
    num_rows: int,
    num_experts: int,
    config: Mapping[str, Any] | None = None,
    intermediate: int = 0,
) -> dict[str, Any]:
    """Launch parameters for `num_rows` (T*K) assignments over `num_experts` of
    `intermediate` channels, `config` overriding the defaults (benchmarks/kernels/
    bench_moe.py sweeps them).

    block_m: assignment rows per block (each block belongs to one expert); block_n:
        output channels per program; block_k: reduction step; num_warps, num_stages.
    """
    per_expert = num_rows / num_experts
    row = next(r for r in _LAUNCH_TABLE if per_expert <= r[0])
    keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    default = dict(zip(keys, row[1:], strict=True))
    if per_expert >= 128 and intermediate >= _LARGE_EXPERT:
        default["block_m"] = 128
    return launch_config("fused_moe", default, config)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    gated: bool = True,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `fused_moe_ref` (same arguments, shapes and result). No host sync:
    safe under CUDA graphs. `config` overrides the launch parameters (see
    `moe_launch_config`); benchmarks and tests only."""
    T, H, E, I, K = _check_moe_args(x, w13, w2, topk_weights, topk_ids, activation, gated)
    if T == 0:
        return torch.zeros_like(x)
    num_rows = T * K
    cfg = moe_launch_config(num_rows, E, config, I)
    block_m, block_n, block_k = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if x.dtype == torch.float32 or interpret_mode():
        # The interpreter mis-computes 16-bit tl.dot; float32 there is also more exact.
        dot_dtype, precision = tl.float32, "ieee"
    else:
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
        precision = "tf32"
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_rows, block_expert = align_by_expert(topk_ids, E, block_m)
    num_blocks = block_expert.shape[0]
    inter = torch.empty(num_rows, I, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(num_blocks, -(-I // block_n))](
        x,
        w13,
        inter,
        sorted_rows,
        block_expert,
        num_rows,
        K,
        H,
        I,
        E,
        *x.stride(),
        *w13.stride(),
        *inter.stride(),
        GATED=gated,
        ACTIVATION=ACTIVATIONS[activation],
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **launch,
    )
    out = torch.empty(num_rows, H, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1)
    _moe_down_kernel[(num_blocks, -(-H // block_n))](
        inter,
        w2,
        out,
        weights,
        sorted_rows,
        block_expert,
        num_rows,
        H,
        I,
        E,
        *inter.stride(),
        *w2.stride(),
        *out.stride(),
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **launch,
    )
    return out.view(T, K, H).sum(1).to(x.dtype)
