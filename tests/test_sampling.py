"""Sampling: seeds, filters (statistically), penalties, stops, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from ssmserve import LLM, SamplingParams
from ssmserve.engine.sampler import Sampler, SamplingRow
from tests.sampler_reference import penalised


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("bamba"), device="cpu", dtype="float32")


PROMPTS = ["def add(a, b):", "import sys\n", "for i in range(10):"]


def texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_same_seed_same_output_whatever_else_is_in_the_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=0.8)  # unseeded neighbours
    batch = llm.generate(PROMPTS + [PROMPTS[0]], [others] * 3 + [params])
    assert batch[3].outputs[0].token_ids == alone
    again = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    assert again == alone
    different = (
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0]
        .outputs[0]
        .token_ids
    )
    assert different != alone


def test_n_samples_with_seed_are_reproducible_and_distinct(llm):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7)
    first = llm.generate([PROMPTS[1]], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert texts([first]) == texts(llm.generate([PROMPTS[1]], params))
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_seeded_requests_keep_their_tokens_in_any_batch_order_chunking_or_preemption(checkpoint):
    path = checkpoint("bamba")
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(9 + i)]} for i in range(4)
    ]
    seeded = [
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=s, ignore_eos=True)
        for s in (5, 6, 7, 8)
    ]
    llm = LLM(path, device="cpu", dtype="float32")
    alone = [llm.generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts, seeded)]
    # Reversed, beside unseeded neighbours, in chunks of 5 tokens, with too few KV blocks
    # for all of them to grow (so some are preempted and recomputed).
    tight = LLM(
        path,
        device="cpu",
        dtype="float32",
        num_kv_blocks=14,
        block_size=4,
        max_num_batched_tokens=5,
    )
    neighbour = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    outs = tight.generate(prompts[::-1] + prompts[:2], seeded[::-1] + [neighbour] * 2)
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone[::-1]
    assert tight.stats()["num_preemptions"] > 0
    assert len({tuple(t) for t in alone}) == 4


def test_sample_zero_of_n_is_the_single_sample_with_that_seed(llm):
    one = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=1.0, seed=21))
    three = llm.generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=21))
    assert three[0].outputs[0].token_ids == one[0].outputs[0].token_ids


def _draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = [SamplingRow(params, 0, [1], [])] * n
    return torch.tensor(Sampler()(logits.expand(n, -1).clone(), rows, gen).token_ids)


LOGITS = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 2


def test_top_k_never_leaves_the_top_k():
    draws = _draw(LOGITS, SamplingParams(temperature=1.0, top_k=5), 4000)
    allowed = set(LOGITS[0].topk(5).indices.tolist())
    assert set(draws.tolist()) == allowed  # all of them, and nothing else


def test_top_p_never_leaves_the_nucleus_and_follows_renormalised_probs():
    probs = LOGITS[0].softmax(-1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    size = int((cum < 0.6).sum()) + 1  # smallest prefix with mass >= 0.6
    allowed = order[:size]
    draws = _draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.6), 6000)
    assert set(draws.tolist()) <= set(allowed.tolist())
    expected = probs[allowed] / probs[allowed].sum()
    freq = torch.tensor([(draws == t).float().mean().item() for t in allowed.tolist()])
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_min_p_drops_tokens_below_the_floor():
    probs = LOGITS[0].softmax(-1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    draws = _draw(LOGITS, SamplingParams(temperature=1.0, min_p=0.2), 4000)
    assert set(draws.tolist()) <= allowed
    assert len(set(draws.tolist())) == len(allowed)


def test_temperature_sampling_matches_the_distribution():
    probs = (LOGITS[0] / 0.7).softmax(-1)
    draws = _draw(LOGITS, SamplingParams(temperature=0.7), 8000)
    freq = torch.bincount(draws, minlength=50).float() / 8000
    assert (freq - probs).abs().max() < 0.025


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = torch.randn(1, 10)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = penalised(logits, [SamplingRow(params, 0, [9], [3, 3, 4])])
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.25 + 0.5
    expected[0, 4] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_matches_transformers(checkpoint):
    path = checkpoint("bamba")
    llm = LLM(path, device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = "x = x + x"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(
        ids,
        max_new_tokens=20,
        do_sample=False,
        repetition_penalty=1.8,
        pad_token_id=tok.eos_token_id,
    )[0, ids.shape[1] :].tolist()
    got = llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.8)
    )[0]
    assert got.outputs[0].token_ids == ref[: len(got.outputs[0].token_ids)]


def test_stop_strings_end_the_text_and_are_not_included(llm):
    base = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )[0].outputs[0]
    stop = base.text[5:8]
    assert stop and stop in base.text
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    cut = base.text.index(stop)
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        [PROMPTS[0]],
        SamplingParams(
            max_tokens=24,
            temperature=0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    base = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    stop_id = base.token_ids[2]
    first = base.token_ids.index(stop_id)
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens forbids the stop token until enough tokens exist.
    out = llm.generate(
        [PROMPTS[2]],
        SamplingParams(
            max_tokens=20, temperature=0, stop_token_ids=[stop_id], min_tokens=first + 2
        ),
    )[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_id not in out.token_ids[: first + 1]


def test_logprobs_shape_and_prompt_logprobs_match_transformers(checkpoint):
    path = checkpoint("bamba")
    llm = LLM(path, device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    prompt = "def greet(name):\n    print(name)"
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=3, prompt_logprobs=2),
    )[0]
    ids = tok(prompt).input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry and len(entry) <= 3
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        assert entry[ids[pos]].rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tid, entry in zip(comp.token_ids, comp.logprobs):
        assert tid in entry and 3 <= len(entry) <= 4
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda x: x.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
    assert math.isclose(
        comp.cumulative_logprob,
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)),
        rel_tol=1e-6,
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
