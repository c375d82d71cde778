"""Naive per-row references for the sampler, and access to its batched stages.

The references walk one row at a time in the plainest way (Python loops over tokens where
that is clearer); the batched sampler must agree with them.
"""

from __future__ import annotations

import math

import torch

from ssmserve.engine.sampler import SamplingRow, _adjusted, _Batch, _filtered

NEG_INF = float("-inf")


def reference_adjusted(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row [V]: repetition, frequency and presence penalties, then min_tokens bans."""
    p = row.params
    z = logits.clone()
    vocab = z.shape[0]
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            if t < vocab:
                z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        if t < vocab:
            z[t] -= p.frequency_penalty * row.output_token_ids.count(t) + p.presence_penalty
    if len(row.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
        for t in banned:
            if t < vocab:
                z[t] = NEG_INF
    return z


def reference_filtered(z: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One sampled row [V]: z / temperature with what top-k, then top-p, then min-p drop
    at -inf (probabilities in float64, tokens walked one by one)."""
    p = row.params
    x = z / p.temperature
    vocab = x.shape[0]
    if 0 < p.top_k < vocab:
        kth = sorted(x.tolist(), reverse=True)[p.top_k - 1]
        x = torch.where(x < kth, NEG_INF, x)
    if p.top_p < 1.0:
        probs = x.double().softmax(-1).tolist()
        keep = set()
        mass = 0.0
        for t in sorted(range(vocab), key=lambda t: -probs[t]):
            if mass >= p.top_p:
                break
            keep.add(t)
            mass += probs[t]
        x = torch.tensor([x[t].item() if t in keep else NEG_INF for t in range(vocab)])
    if p.min_p > 0.0:
        probs = x.double().softmax(-1)
        x = torch.where(probs < p.min_p * probs.max(), NEG_INF, x)
    return x


def reference_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """float64 [V]: the distribution a sampled row draws from."""
    return reference_filtered(reference_adjusted(logits, row), row).double().softmax(-1)


def stages(logits: torch.Tensor, rows: list[SamplingRow]):
    """The sampler's own (adjusted, filtered) logits for a batch; filtered is None when no
    row samples."""
    batch = _Batch(rows, logits.shape[1], logits.shape[0], None)
    dev = batch.upload(logits.device)
    z = _adjusted(logits.float(), batch, dev)
    return z, (_filtered(z, batch, dev) if batch.sampled else None)


def penalised(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return stages(logits, rows)[0]


def chi_square_bound(dof: int, z: float = 4.5) -> float:
    """Upper quantile of chi-square(dof) at a normal z-score (Wilson-Hilferty); z = 4.5 is
    a false-alarm rate of about 3e-6."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probs, and its degrees of freedom.
    Tokens with zero probability must never be drawn (checked here)."""
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the filters drop"
    n = counts.sum()
    expected = probs[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1
