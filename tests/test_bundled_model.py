"""The small models bundled in the package: found from the installed package, and
ssmserve's greedy output equals transformers' on held-out Python source.

The prompts are deterministic cuts of standard-library modules that the models
never saw in training (ssmserve/model_data/heldout_prompts.json, written by
``scripts/train_tiny.py snippets``), so these are real-text prompts with confident,
non-random next tokens.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch

BUNDLED = ("ssmserve-bamba-tiny", "ssmserve-mamba2-tiny", "ssmserve-mamba-tiny")
EXPECTED_ARCHITECTURE = {
    "ssmserve-bamba-tiny": "BambaForCausalLM",
    "ssmserve-mamba2-tiny": "Mamba2ForCausalLM",
    "ssmserve-mamba-tiny": "MambaForCausalLM",
}
MAX_BUNDLED_WEIGHT_BYTES = 20_000_000
NUM_PROMPTS = 64
# The default model gets every prompt; the others a quarter, to keep the file fast.
NUM_PROMPTS_BY_MODEL = {
    "ssmserve-bamba-tiny": 64,
    "ssmserve-mamba2-tiny": 16,
    "ssmserve-mamba-tiny": 16,
}
MAX_NEW_TOKENS = 16


def bundled_path(name: str) -> Path:
    """The folder as the installed package exposes it (never a path relative to the repo)."""
    traversable = resources.files("ssmserve").joinpath("model_data", name)
    # NOTE: package data is installed as plain files (not zipped), so this is a real folder.
    return Path(str(traversable))


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """64 prompts of 20 to 60 tokens, the same on every machine."""
    data = resources.files("ssmserve").joinpath("model_data", "heldout_prompts.json")
    snippets = json.loads(data.read_text(encoding="utf-8"))["snippets"]
    assert len(snippets) >= NUM_PROMPTS
    prompts = []
    for i, snippet in enumerate(snippets[:NUM_PROMPTS]):
        ids = tokenizer.encode(snippet["text"], add_special_tokens=False)
        length = 20 + (i * 7) % 41
        assert len(ids) >= length, f"snippet {i} has only {len(ids)} tokens"
        prompts.append(ids[:length])
    return prompts


def strip_eos(ids: list[int], eos: int) -> list[int]:
    # HF stops at EOS and keeps it; ssmserve may or may not report it. Compare up to it.
    return ids[: ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_folder_is_complete_in_installed_package(name):
    import ssmserve

    path = bundled_path(name)
    package_dir = Path(ssmserve.__file__).resolve().parent
    assert path.resolve().is_relative_to(package_dir), path
    for file in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        assert (path / file).is_file(), f"{name}/{file} missing from the installed package"
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [EXPECTED_ARCHITECTURE[name]]


def test_bundled_weights_fit_the_size_budget():
    total = sum((bundled_path(n) / "model.safetensors").stat().st_size for n in BUNDLED)
    assert total <= MAX_BUNDLED_WEIGHT_BYTES, f"bundled weights are {total} bytes"


def test_bundled_models_cover_tied_and_untied_embeddings():
    tied = {
        json.loads((bundled_path(n) / "config.json").read_text()).get("tie_word_embeddings")
        for n in BUNDLED
    }
    assert tied == {True, False}


def test_tokenizer_round_trips_and_renders_chat():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_path("ssmserve-bamba-tiny"))
    data = resources.files("ssmserve").joinpath("model_data", "heldout_prompts.json")
    for snippet in json.loads(data.read_text(encoding="utf-8"))["snippets"]:
        ids = tokenizer.encode(snippet["text"], add_special_tokens=False)
        assert tokenizer.decode(ids) == snippet["text"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def f():"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|user|>\ndef f():\n<|assistant|>\n"
    assert tokenizer.eos_token == "<|endoftext|>" == tokenizer.pad_token == tokenizer.bos_token


@pytest.mark.parametrize("name", BUNDLED)
def test_greedy_continuations_match_transformers(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ssmserve import LLM, SamplingParams

    path = bundled_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = prompt_token_ids(tokenizer)[: NUM_PROMPTS_BY_MODEL[name]]
    eos = tokenizer.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                min_new_tokens=0,
                pad_token_id=eos,
            )
            expected.append(strip_eos(out[0, len(ids) :].tolist(), eos))
    del model

    llm = LLM(model=str(path), dtype="float32", device="cpu")
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0),
    )
    assert len(outputs) == len(prompts)
    mismatches = []
    for i, (output, want) in enumerate(zip(outputs, expected, strict=True)):
        got = strip_eos(list(output.outputs[0].token_ids), eos)
        if got != want:
            mismatches.append((i, tokenizer.decode(prompts[i][-10:]), want, got))
    assert not mismatches, (
        f"{len(mismatches)}/{len(prompts)} prompts differ, first: {mismatches[0]}"
    )
    # The model is trained: most greedy continuations run the full length (no early EOS).
    assert sum(len(e) == MAX_NEW_TOKENS for e in expected) >= len(prompts) // 2
