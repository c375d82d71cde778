"""#18.10: bundled models load by name; a hub id that is not cached says how to get it."""

from __future__ import annotations

import os

import pytest

from ssmserve.config import bundled_model_names, bundled_model_path, resolve_model_path
from ssmserve.llm import LLM
from ssmserve.sampling_params import SamplingParams


def test_every_bundled_model_resolves_by_name():
    names = bundled_model_names()
    assert {"ssmserve-bamba-tiny", "ssmserve-mamba-tiny", "ssmserve-mamba2-tiny"} <= set(names)
    for name in names:
        path = resolve_model_path(name)
        assert path == bundled_model_path(name) and os.path.isfile(
            os.path.join(path, "config.json")
        )


def test_llm_by_bundled_name_is_the_bundled_model():
    params = SamplingParams(max_tokens=4, temperature=0)
    by_name = LLM("ssmserve-mamba2-tiny", device="cpu")
    by_path = LLM(bundled_model_path("ssmserve-mamba2-tiny"), device="cpu")
    assert by_name.llm_engine.model_config.architecture == "Mamba2ForCausalLM"
    assert (
        by_name.generate("def fib(n):", params)[0].outputs[0].token_ids
        == by_path.generate("def fib(n):", params)[0].outputs[0].token_ids
    )


def test_missing_hub_model_suggests_hf_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    with pytest.raises(FileNotFoundError, match=r"hf download nobody/no-such-model"):
        resolve_model_path("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="ssmserve-bamba-tiny"):
        resolve_model_path("ssmserve-no-such-tiny")  # lists the bundled names
