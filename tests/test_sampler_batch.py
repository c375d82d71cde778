"""The batched sampler against naive per-row references: penalties, bans, filters, the
drawn distributions, greedy exactness, logprobs, and seeded reproducibility."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from ssmserve import SamplingParams
from ssmserve.engine.sampler import Sampler, SamplingRow, _seeded_log_exponentials
from tests.sampler_reference import (
    chi_square,
    chi_square_bound,
    reference_adjusted,
    reference_filtered,
    reference_probs,
    stages,
)

VOCAB = 64
EOS = 5


def _logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _random_row(rng: random.Random, sampled: bool | None = None) -> SamplingRow:
    """A row with a random mix of every setting the sampler reads."""
    sampled = rng.random() < 0.7 if sampled is None else sampled
    kwargs: dict = dict(max_tokens=100, eos_token_ids=(EOS,))
    kwargs["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.6]) if sampled else 0.0
    if rng.random() < 0.5:
        kwargs["top_k"] = rng.choice([1, 3, 10, VOCAB - 1, VOCAB, VOCAB + 5])
    if rng.random() < 0.5:
        kwargs["top_p"] = rng.choice([0.05, 0.5, 0.9, 0.999])
    if rng.random() < 0.3:
        kwargs["min_p"] = rng.choice([0.01, 0.2, 0.7])
    if rng.random() < 0.4:
        kwargs["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        kwargs["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        kwargs["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.3:
        kwargs["min_tokens"] = rng.randint(1, 8)
        kwargs["stop_token_ids"] = [rng.randrange(VOCAB), VOCAB + 3]
    if rng.random() < 0.2:
        kwargs["ignore_eos"] = True
    if sampled and rng.random() < 0.5:
        kwargs["seed"] = rng.randrange(2**64)
    if rng.random() < 0.4:
        kwargs["logprobs"] = rng.choice([0, 1, 4])
    # Ids past the vocabulary (a tokenizer larger than the LM head) must count nowhere.
    prompt = [rng.randrange(VOCAB + 4) for _ in range(rng.randint(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))]
    if rng.random() < 0.3:
        output += [VOCAB - 1, VOCAB + 1]  # the second must not count as the first
    return SamplingRow(SamplingParams(**kwargs), rng.randrange(3), prompt, output)


def test_penalties_and_bans_match_the_per_row_reference():
    rng = random.Random(1)
    rows = [_random_row(rng) for _ in range(40)]
    logits = _logits(len(rows))
    z, _ = stages(logits, rows)
    assert any(r.params.has_penalties for r in rows) and any(
        len(r.output_token_ids) < r.params.min_tokens for r in rows
    )
    for i, row in enumerate(rows):
        torch.testing.assert_close(z[i], reference_adjusted(logits[i], row))


def test_penalties_when_every_row_has_them_and_when_one_does():
    rng = random.Random(2)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.3)
    rows = [SamplingRow(params, 0, [1, 2, 2], [rng.randrange(VOCAB) for _ in range(9)])] * 3
    logits = _logits(3, seed=2)
    for batch in (rows, rows[:1]):
        z, _ = stages(logits[: len(batch)], batch)
        for i, row in enumerate(batch):
            torch.testing.assert_close(z[i], reference_adjusted(logits[i], row))
    plain = SamplingRow(SamplingParams(), 0, [1], [3])
    z, _ = stages(logits, [plain, rows[0], plain])
    assert torch.equal(z[0], logits[0]) and torch.equal(z[2], logits[2])
    torch.testing.assert_close(z[1], reference_adjusted(logits[1], rows[0]))


@pytest.mark.parametrize(
    "kinds",
    [("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p", "min_p"), ("paired",), ("mixed",)],
)
def test_filter_masks_match_the_per_row_reference(kinds):
    rng = random.Random(hash(kinds) % 1000)
    rows = []
    for _ in range(48):
        kwargs: dict = dict(temperature=rng.choice([0.5, 1.0, 1.4]))
        if "top_k" in kinds or ("mixed" in kinds and rng.random() < 0.4):
            kwargs["top_k"] = rng.choice([1, 2, 7, 20, VOCAB - 1])
        if "top_p" in kinds or ("mixed" in kinds and rng.random() < 0.4):
            kwargs["top_p"] = rng.uniform(0.05, 0.99)
        if "min_p" in kinds or ("mixed" in kinds and rng.random() < 0.4):
            kwargs["min_p"] = rng.uniform(0.01, 0.9)
        if "mixed" in kinds and rng.random() < 0.2:
            kwargs["temperature"] = 0.0
        if "paired" in kinds:  # every top-p row has a top-k: no whole-row sort
            kwargs.update(
                rng.choice(
                    [
                        dict(top_k=rng.choice([1, 5, 30]), top_p=rng.uniform(0.05, 0.99)),
                        dict(top_k=rng.choice([2, 40])),
                        dict(min_p=rng.choice([1e-4, 0.3])),
                        {},
                    ]
                )
            )
        rows.append(SamplingRow(SamplingParams(**kwargs), 0, [1], []))
    logits = _logits(len(rows), seed=3)
    _, filtered = stages(logits, rows)
    for i, row in enumerate(rows):
        if row.params.greedy:
            assert torch.equal(filtered[i], logits[i])
            continue
        ref = reference_filtered(logits[i], row)
        assert torch.equal(filtered[i].isfinite(), ref.isfinite()), (i, row.params)
        kept = ref.isfinite()
        torch.testing.assert_close(filtered[i][kept], ref[kept])


def test_greedy_rows_are_exact_argmax_ties_included_beside_sampled_rows():
    # Small integer logits: many ties, which torch.argmax breaks at the first index.
    logits = torch.randint(0, 4, (30, VOCAB), generator=torch.Generator().manual_seed(4)).float()
    rng = random.Random(4)
    rows = []
    for i in range(30):
        if i % 3 == 0:
            rows.append(SamplingRow(SamplingParams(temperature=0.0, logprobs=2), 0, [1], []))
        else:
            rows.append(_random_row(rng, sampled=True))
    out = Sampler()(logits, rows, torch.Generator().manual_seed(0))
    for i in range(0, 30, 3):
        assert out.token_ids[i] == int(torch.argmax(logits[i]))
    greedy_only = Sampler()(logits, [rows[0]] * 30, None)
    assert greedy_only.token_ids == logits.argmax(-1).tolist()


def _draw_counts(logits_row: torch.Tensor, rows: list[SamplingRow], gen) -> torch.Tensor:
    out = Sampler()(logits_row.expand(len(rows), -1).contiguous(), rows, gen)
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double()


SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=12),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, min_p=0.1, presence_penalty=1.0, repetition_penalty=1.5),
]


@pytest.mark.parametrize("seeded", [False, True], ids=["engine generator", "seeded"])
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(s))
def test_draws_follow_the_reference_distribution(setting, seeded):
    """Chi-square of 6000 draws against the reference probabilities (false alarm ~3e-6;
    a wrong temperature or filter gives statistics in the hundreds)."""
    logits = _logits(1, seed=5, scale=1.5)[0]
    n = 6000
    # Seeded rows differ in seed and sample index, so each has its own noise key.
    rows = [
        SamplingRow(SamplingParams(seed=s if seeded else None, **setting), s % 3, [4, 9], [7, 7])
        for s in range(n)
    ]
    counts = _draw_counts(logits, rows, torch.Generator().manual_seed(11))
    stat, dof = chi_square(counts, reference_probs(logits, rows[0]))
    assert stat < chi_square_bound(dof), (stat, dof)


def test_seeded_noise_is_exponential_and_independent_across_keys():
    seeds, indices, positions = (0, 1, 2**40 + 7, 2**64 - 1), (0, 1), range(250)
    fields = torch.tensor(
        [[s >> 32, s & 0xFFFFFFFF, i, pos] for s in seeds for i in indices for pos in positions]
    )
    e = _seeded_log_exponentials(fields, VOCAB).double().exp()
    assert torch.isfinite(e).all() and (e > 0).all()
    flat = e.flatten().sort().values
    n = flat.numel()
    empirical = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = (empirical - (1 - torch.exp(-flat))).abs().max().item()
    assert ks < 2.23 / n**0.5, ks  # Kolmogorov-Smirnov at a false-alarm rate of 1e-4
    # Back to uniforms [seed, sample index, position, token]: neighbouring keys and tokens
    # must not be correlated (a key part left out of the hash gives a correlation of 1).
    u = (1 - torch.exp(-e)).view(len(seeds), len(indices), len(positions), VOCAB)
    pairs = {
        "next position": (u[:, :, :-1], u[:, :, 1:]),
        "other sample index": (u[:, 0], u[:, 1]),
        "next seed": (u[:-1], u[1:]),
        "next token": (u[..., :-1], u[..., 1:]),
    }
    for name, (x, y) in pairs.items():
        corr = torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1].item()
        assert abs(corr) < 5 / x.numel() ** 0.5, (name, corr)


def test_a_seeded_row_draws_the_same_token_alone_or_in_any_batch():
    rng = random.Random(6)
    seeded = []
    for _ in range(60):
        row = _random_row(rng, sampled=True)
        row.params = dataclasses.replace(row.params, seed=rng.randrange(2**64))
        seeded.append(row)
    logits = _logits(len(seeded), seed=6, scale=0.5)  # flat: the noise decides
    alone = [Sampler()(logits[i : i + 1], [r], None).token_ids[0] for i, r in enumerate(seeded)]
    # The same rows among unseeded and greedy neighbours, shuffled, read through logits_rows.
    others = []
    for _ in range(40):
        row = _random_row(rng)
        row.params = dataclasses.replace(row.params, seed=None)
        others.append(row)
    every_logits = torch.cat([logits, _logits(len(others), seed=7)])
    every_row = seeded + others
    order = list(range(len(every_row)))
    rng.shuffle(order)
    out = Sampler()(
        every_logits.flip(0),
        [every_row[j] for j in order],
        torch.Generator().manual_seed(1),
        [len(every_row) - 1 - j for j in order],
    )
    together = {j: out.token_ids[k] for k, j in enumerate(order)}
    assert [together[i] for i in range(len(seeded))] == alone
    assert len(set(alone)) > 10  # the seeds do pick different tokens


def test_seed_sample_index_and_position_each_change_the_draw():
    logits = torch.zeros(1, VOCAB)  # uniform: every token equally likely

    def token(seed, index, position):
        row = SamplingRow(SamplingParams(seed=seed), index, [1], [0] * position)
        return Sampler()(logits, [row], None).token_ids[0]

    base = [token(3, 0, p) for p in range(30)]
    assert len(set(base)) > 15  # positions give fresh draws
    assert base == [token(3, 0, p) for p in range(30)]
    assert base != [token(4, 0, p) for p in range(30)]
    assert base != [token(3, 1, p) for p in range(30)]


def test_logprobs_ranks_and_top_alternatives_are_of_the_raw_distribution():
    rng = random.Random(8)
    rows = [_random_row(rng) for _ in range(40)]
    logits = _logits(len(rows), seed=8)
    out = Sampler()(logits, rows, torch.Generator().manual_seed(2))
    raw = logits.double().log_softmax(-1)
    assert any(r.params.logprobs for r in rows) and any(r.params.logprobs is None for r in rows)
    for i, row in enumerate(rows):
        t = out.token_ids[i]
        assert abs(out.logprobs[i] - raw[i, t].item()) < 1e-5
        k = row.params.logprobs
        if k is None:
            assert out.ranks[i] is None and out.top_ids[i] == [] and out.top_logprobs[i] == []
            continue
        assert out.ranks[i] == int((raw[i] > raw[i, t]).sum()) + 1
        top = raw[i].topk(k)
        assert out.top_ids[i] == top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor(out.top_logprobs[i]).double(), top.values, rtol=0, atol=1e-5
        )


def test_min_tokens_bans_eos_and_stop_ids_until_enough_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 30.0
    logits[0, 9] = 29.0
    logits[0, 11] = 28.0

    def tokens(output_len, seeded=False, **kwargs):
        rows = [
            SamplingRow(
                SamplingParams(
                    min_tokens=3,
                    eos_token_ids=(EOS,),
                    stop_token_ids=[9],
                    seed=s if seeded else None,
                    **kwargs,
                ),
                0,
                [1],
                [2] * output_len,
            )
            for s in range(200)
        ]
        return set(Sampler()(logits.expand(200, -1), rows, None).token_ids)

    assert tokens(2, temperature=0.0) == {11}
    assert tokens(3, temperature=0.0) == {EOS}
    assert tokens(2, temperature=0.0, ignore_eos=True) == {EOS}
    for seeded in (False, True):
        assert 11 in tokens(2, seeded, temperature=1.0)
        assert not {EOS, 9} & tokens(2, seeded, temperature=1.0)
        assert {EOS, 9} <= tokens(3, seeded, temperature=1.0)


def test_logits_rows_pick_each_rows_logits():
    logits = _logits(6, seed=9)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 0, [1], []),
        SamplingRow(SamplingParams(seed=5), 0, [1], []),
    ]
    picked = Sampler()(logits, rows, None, [4, 1])
    direct = Sampler()(logits[[4, 1]], rows, None)
    assert picked == direct
    assert picked.token_ids[0] == int(logits[4].argmax())


def test_mismatched_rows_say_what_to_pass():
    rows = [SamplingRow(SamplingParams(), 0, [1], [])]
    with pytest.raises(ValueError, match="logits_rows"):
        Sampler()(_logits(2), rows, None)
    with pytest.raises(ValueError, match="one logits row per sampling row"):
        Sampler()(_logits(2), rows, None, [0, 1])
