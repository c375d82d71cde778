"""Sampler: penalties, min_tokens, temperature, top-k / top-p / min-p, per-request seeds.

Logprobs are those of the model's raw distribution (log-softmax of the logits before
penalties and temperature), as vLLM returns by default and as HF's log-softmax gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssmserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs for one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request when seeded, else the engine's
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: torch.Tensor  # [B] raw logprob of each sampled token
    ranks: torch.Tensor | None  # [B] rank in the raw distribution (1 = top), if asked for
    top_ids: torch.Tensor | None  # [B, K] top alternatives (K = max requested), or None
    top_logprobs: torch.Tensor | None


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        vocab = logits.shape[1]
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        out = out[out < vocab]
        counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            ids = torch.tensor(
                row.prompt_token_ids + row.output_token_ids, dtype=torch.long, device=logits.device
            )
            seen[ids[ids < vocab]] = True
            penalised = torch.where(
                logits[i] > 0, logits[i] / p.repetition_penalty, logits[i] * p.repetition_penalty
            )
            logits[i] = torch.where(seen, penalised, logits[i])
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _mask_early_stops(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Scale by temperature and drop tokens outside top-k / top-p / min-p (to -inf)."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=dev)
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    top_k = [r.params.top_k for r in rows]
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    if (top_p < 1.0).any():
        probs_sorted, idx = logits.softmax(-1).sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p.
        mass_before = probs_sorted.cumsum(-1) - probs_sorted
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
    if (min_p > 0).any():
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [B, V] (any float dtype) -> one token per row."""
        logits = logits.float()
        raw_logprobs = logits.log_softmax(-1)
        logits = logits.clone()
        _apply_penalties(logits, rows)
        _mask_early_stops(logits, rows)
        greedy = [r.params.greedy for r in rows]
        chosen = logits.argmax(-1)
        if not all(greedy):
            filtered = _filter(logits, rows)
            probs = filtered.softmax(-1)
            for i, row in enumerate(rows):
                if greedy[i]:
                    continue
                # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and one
                # draw of V exponentials per row keeps each request's stream its own.
                noise = torch.empty_like(probs[i]).exponential_(generator=row.generator)
                noise.clamp_(min=1e-30)  # a zero draw would divide a banned token by 0
                chosen[i] = (probs[i] / noise).argmax()
        chosen_lp = raw_logprobs.gather(1, chosen[:, None]).squeeze(1)
        ranks = None
        if any(r.params.logprobs is not None for r in rows):
            ranks = (raw_logprobs > chosen_lp[:, None]).sum(-1) + 1
        k = max((r.params.logprobs or 0) for r in rows)
        top_ids = top_lps = None
        if k > 0:
            top_lps, top_ids = raw_logprobs.topk(min(k, raw_logprobs.shape[1]), dim=-1)
        return SamplerOutput(chosen.tolist(), chosen_lp, ranks, top_ids, top_lps)
