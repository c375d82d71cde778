"""Sampling defaults from the checkpoint's generation_config.json (vLLM's
`--generation-config auto`): what is read, who takes it, and who keeps their own."""

from __future__ import annotations

import json
import shutil

import pytest

from ssmserve import LLM, SamplingParams
from ssmserve.config import read_generation_config, sampling_defaults_from
from ssmserve.server.protocol import CompletionRequest
from ssmserve.server.serving import sampling_params

GENERATION = {
    "bos_token_id": 0,
    "eos_token_id": 0,
    "do_sample": True,
    "max_new_tokens": 77,  # not a sampling default
    "temperature": 0.0,
    "repetition_penalty": 1.7,
    "top_k": 5,
}


@pytest.fixture(scope="module")
def folder(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("generation") / "model"
    shutil.copytree(checkpoint("bamba"), path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return str(path)


def test_the_sampling_fields_are_read_and_nothing_else(folder):
    defaults = sampling_defaults_from(read_generation_config(folder))
    assert defaults == {"temperature": 0.0, "repetition_penalty": 1.7, "top_k": 5}


def test_generate_without_params_uses_them_and_vllm_ignores_them(folder):
    prompt = {"prompt_token_ids": [5, 9, 5, 9, 5, 9, 5, 9]}
    llm = LLM(folder, device="cpu", dtype="float32")
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.repetition_penalty, params.top_k) == (0.0, 1.7, 5)
    got = llm.generate(prompt, use_tqdm=False)[0].outputs[0]  # no params: the defaults
    explicit = SamplingParams(temperature=0.0, repetition_penalty=1.7, top_k=5)
    assert got.token_ids == llm.generate(prompt, explicit, use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(folder, device="cpu", dtype="float32", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    sampled = plain.generate(prompt, use_tqdm=False)[0].outputs[0]  # temperature 1
    assert sampled.token_ids != got.token_ids


def test_a_request_keeps_what_it_sets_and_takes_the_rest():
    defaults = {"temperature": 0.0, "repetition_penalty": 1.7, "top_k": 5}
    req = CompletionRequest(prompt="a", repetition_penalty=1.1, top_p=0.5)
    params = sampling_params(req, max_tokens=4, logprobs=None, defaults=defaults)
    assert (params.temperature, params.top_k) == (0.0, 5)  # from the model
    assert (params.repetition_penalty, params.top_p) == (1.1, 0.5)  # the request's own
    builtin = sampling_params(req, max_tokens=4, logprobs=None)
    assert (builtin.temperature, builtin.top_k) == (1.0, 0)


def test_another_folder_or_a_bad_value_is_named(folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.25}))
    llm = LLM(folder, device="cpu", dtype="float32", generation_config=str(other))
    assert llm.get_default_sampling_params() == SamplingParams(top_p=0.25)
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        LLM(folder, device="cpu", dtype="float32", generation_config=str(tmp_path / "none"))
    (other / "generation_config.json").write_text(json.dumps({"top_p": 7.0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        LLM(folder, device="cpu", dtype="float32", generation_config=str(other))


def test_ssmserve_generate_flags_left_unset_take_the_model_defaults():
    import argparse

    from ssmserve.cli import _sampling_params, add_sampling_args

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args(["--top-k", "3"])
    params = _sampling_params(args, {"top_k": 5, "repetition_penalty": 1.7, "top_p": 0.5})
    assert (params.top_k, params.repetition_penalty, params.top_p) == (3, 1.7, 0.5)
    assert params.temperature == 0.0  # the command's own default: greedy
    assert _sampling_params(args).repetition_penalty == 1.0
