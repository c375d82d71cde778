"""16-bit SSM state with stochastic rounding, end to end: the flag reaches the decode
update of both mixers, its output stays close to float32 state's, it is deterministic
given the seed, and a request's output does not depend on its batch."""

from __future__ import annotations

import argparse

import pytest

from ssmserve import LLM, SamplingParams
from ssmserve.config import EngineConfig, add_engine_args

FAMILIES = ["bamba", "mamba"]  # Mamba2 and Mamba1 mixers
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n",
    "class Queue:\n    def __init__(self):\n",
    "for i in range(10):",
]


def run(path: str, prompts=PROMPTS, **state) -> list[tuple[list[int], list[float]]]:
    llm = LLM(path, device="cpu", dtype="float32", enable_prefix_caching=False, **state)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    results = []
    for out in outs:
        sample = out.outputs[0]
        chosen = [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
        results.append((list(sample.token_ids), chosen))
    return results


BF16_SR = dict(mamba_ssm_cache_dtype="bfloat16", mamba_ssm_stochastic_rounding=True)


def test_stochastic_rounding_needs_a_16_bit_state():
    with pytest.raises(ValueError, match="--mamba-ssm-cache-dtype bfloat16"):
        EngineConfig(mamba_ssm_stochastic_rounding=True)
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--mamba-ssm-cache-dtype", "float16", "--mamba-ssm-stochastic-rounding"]
    )
    config = EngineConfig.from_args(args)
    assert config.mamba_ssm_stochastic_rounding and config.mamba_ssm_cache_dtype == "float16"
    assert not EngineConfig.from_args(parser.parse_args([])).mamba_ssm_stochastic_rounding


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_state_with_stochastic_rounding_follows_float32_state(checkpoint, family):
    path = checkpoint(family)
    exact = run(path)
    nearest = run(path, mamba_ssm_cache_dtype="bfloat16")
    rounded = run(path, **BF16_SR)
    tokens = [t for toks, _ in exact for t in toks]
    agree = sum(
        a == b for (ta, _), (tb, _) in zip(rounded, exact, strict=True) for a, b in zip(ta, tb)
    )
    assert agree / len(tokens) >= 0.9, agree
    # Where the tokens agree, the logprobs are close to float32 state's, and the flag
    # reached the update: they are not round-to-nearest's.
    deltas, moved = [], False
    for (ta, la), (tb, lb), (tn, ln) in zip(rounded, exact, nearest, strict=True):
        common = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        deltas += [abs(a - b) for a, b in zip(la[:common], lb[:common])]
        moved |= ta != tn or la != ln
    assert max(deltas) < 0.1
    assert moved
    assert run(path, **BF16_SR) == rounded  # deterministic given the seed


def test_stochastic_rounding_gives_a_request_the_same_output_alone_and_batched(checkpoint):
    """The noise is keyed by position, not by batch row or state slot."""
    path = checkpoint("bamba")
    batched = run(path, **BF16_SR, max_num_seqs=4)
    alone = [run(path, [p], **BF16_SR)[0] for p in PROMPTS[:2]]
    assert [tokens for tokens, _ in batched[:2]] == [tokens for tokens, _ in alone]
