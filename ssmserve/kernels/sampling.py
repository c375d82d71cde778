"""The sampler's draw and the drawn token's logprob in two launches, for the common rows.

Rows that are all greedy, or all sampled from the engine's generator with only a
temperature (no penalties, bans, filters, seeds or logprobs asked), need from the
sampler (engine/sampler.py) only: scores = z / T - log E over the row (E the noise it
drew, clamped to the smallest normal float; z itself for greedy rows), the first index of
their maximum, and that token's raw logprob, z[c] - logsumexp(z). The sampler's tensor ops
take about a dozen launches a step for that (scale, clamp, log, subtract, argmax, the
log-softmax, the gather, the casts and the packing), each over the whole [B, V] row.
Here a first launch reduces chunks of each row (their best score and its first index,
their max and sum of exponentials of z), a second merges a row's chunks and writes the
sampled ids and their logprobs, packed as the sampler copies them to the host. The same
operations as the sampler's, rounded the same way (IEEE division; Triton lowers the log to
libdevice's logf, CUDA's own), so the same token; the logprob's sum in another order.
"""

from __future__ import annotations

import torch

from ssmserve.kernels._common import cdiv, lazy_jit, next_pow2, tl

CHUNK = 4096  # row elements a first-launch program reduces


def draw_ref(
    logits: torch.Tensor, temps: torch.Tensor | None, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] float32; temps [B] (float64, the sampler's upload) and noise [B, V]
    Exp(1) draws for sampled rows, both None for greedy rows -> (chosen [B] int64,
    packed [2B] float64: the chosen ids, then their raw logprobs), as the sampler's
    tensor ops compute them."""
    scores = logits
    if temps is not None:
        scores = logits / temps.float()[:, None]
        scores -= noise.clamp(min=torch.finfo(torch.float32).tiny).log()
    chosen = scores.argmax(-1)
    logprob = logits.log_softmax(-1).gather(1, chosen[:, None]).squeeze(1)
    return chosen, torch.cat([chosen.double(), logprob.double()])


@lazy_jit
def _draw_chunks_kernel(
    logits_ptr,
    temps_ptr,
    noise_ptr,
    best_ptr,
    index_ptr,
    max_ptr,
    sum_ptr,
    V,
    stride_l,
    stride_n,
    num_chunks,
    SAMPLED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    z = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=-float("inf"))
    if SAMPLED:
        t = tl.load(temps_ptr + row).to(tl.float32)
        e = tl.load(noise_ptr + row * stride_n + offs, mask=mask, other=1.0)
        e = tl.maximum(e, 1.1754943508222875e-38)  # the smallest normal float32
        score = tl.math.div_rn(z, t) - tl.log(e)
        score = tl.where(mask, score, -float("inf"))
    else:
        score = z
    best = tl.max(score, axis=0)
    first = tl.min(tl.where(score == best, offs, V), axis=0)
    m = tl.max(z, axis=0)
    total = tl.sum(tl.exp(z - tl.where(m == -float("inf"), 0.0, m)), axis=0)
    at = row * num_chunks + chunk
    tl.store(best_ptr + at, best)
    tl.store(index_ptr + at, first)
    tl.store(max_ptr + at, m)
    tl.store(sum_ptr + at, total)


@lazy_jit(do_not_specialize=("B",))  # one compile for every batch
def _draw_merge_kernel(
    logits_ptr,
    best_ptr,
    index_ptr,
    max_ptr,
    sum_ptr,
    chosen_ptr,
    packed_ptr,
    B,
    V,
    stride_l,
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    at = row * num_chunks + offs
    best = tl.load(best_ptr + at, mask=mask, other=-float("inf"))
    index = tl.load(index_ptr + at, mask=mask, other=V)
    top = tl.max(best, axis=0)
    # The first chunk's first index among the maxima: the row's first maximum.
    chosen = tl.min(tl.where(best == top, index, V), axis=0)
    chosen = tl.minimum(chosen, V - 1)  # a row of NaN: any in-range index
    m = tl.load(max_ptr + at, mask=mask, other=-float("inf"))
    total = tl.load(sum_ptr + at, mask=mask, other=0.0)
    big = tl.max(m, axis=0)
    safe = tl.where(big == -float("inf"), 0.0, big)
    scale = tl.where(m == -float("inf"), 0.0, tl.exp(m - safe))
    lse = safe + tl.log(tl.sum(total * scale, axis=0))
    logprob = tl.load(logits_ptr + row * stride_l + chosen) - lse
    tl.store(chosen_ptr + row, chosen.to(tl.int64))
    tl.store(packed_ptr + row, chosen.to(tl.float64))
    tl.store(packed_ptr + B + row, logprob.to(tl.float64))


def draw_triton(
    logits: torch.Tensor, temps: torch.Tensor | None, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `draw_ref` (same arguments and results; the logprob's sum in
    another order), two launches."""
    B, V = logits.shape
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("draw: the logits must be float32 with contiguous rows")
    if (temps is None) != (noise is None):
        raise ValueError("draw: a sampled draw takes both temps and noise, a greedy one neither")
    num_chunks = cdiv(V, CHUNK)
    # Each its own allocation: views at offsets that follow B would change the pointers'
    # alignment, and with it the compiled variant, from batch to batch.
    best, maxes, sums = (
        torch.empty(B, num_chunks, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    index = torch.empty(B, num_chunks, dtype=torch.int32, device=logits.device)
    chosen = torch.empty(B, dtype=torch.int64, device=logits.device)
    packed = torch.empty(2 * B, dtype=torch.float64, device=logits.device)
    if B == 0:
        return chosen, packed
    sampled = temps is not None
    _draw_chunks_kernel[(B, num_chunks)](
        logits,
        temps if sampled else logits,
        noise if sampled else logits,
        best,
        index,
        maxes,
        sums,
        V,
        logits.stride(0),
        noise.stride(0) if sampled else 0,
        num_chunks,
        SAMPLED=sampled,
        BLOCK=CHUNK,
        num_warps=8,
    )
    _draw_merge_kernel[(B,)](
        logits,
        best,
        index,
        maxes,
        sums,
        chosen,
        packed,
        B,
        V,
        logits.stride(0),
        num_chunks,
        BLOCK_C=max(16, next_pow2(num_chunks)),
        num_warps=1,
    )
    return chosen, packed
