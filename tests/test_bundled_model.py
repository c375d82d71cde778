"""The small models bundled in the package: found from the installed package,
ssmserve's greedy output equals transformers' on held-out Python source, and the
default model's chat replies end with EOS by themselves.

The prompts are deterministic cuts of standard-library modules that the models
never saw in training, and write requests for functions of held-out modules and
packages (ssmserve/model_data/heldout_prompts.json, written by
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
MAX_BUNDLED_WEIGHT_BYTES = 25_000_000
NUM_PROMPTS = 64
# The default model gets every prompt; the others a quarter, to keep the file fast.
NUM_PROMPTS_BY_MODEL = {
    "ssmserve-bamba-tiny": 64,
    "ssmserve-mamba2-tiny": 16,
    "ssmserve-mamba-tiny": 16,
}
MAX_NEW_TOKENS = 16
CHAT_MAX_TOKENS = 256
# The chat example of the README (scripts/install_tiny.py README_CHAT_PROMPT).
README_CHAT_PROMPT = "Write a Python function `is_prime(n)` that returns True if n is a prime."


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


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos: int, penalty: float) -> list:
    """transformers' greedy continuation of `ids` (EOS kept where it stops), with the
    repetition penalty given: generate() would otherwise take the folder's default."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            pad_token_id=eos,
            repetition_penalty=penalty,
        )
    return out[0, len(ids) :].tolist()


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
    expected = [strip_eos(hf_greedy(model, ids, MAX_NEW_TOKENS, eos, 1.0), eos) for ids in prompts]
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


def _trained_for_chat() -> bool:
    """Whether the training run's data held chat conversations (its report says)."""
    report = json.loads((bundled_path("ssmserve-bamba-tiny") / "training_report.json").read_text())
    return "chat" in report.get("data_meta", {}).get("sources", {})


# NOTE: the bundled weights that predate chat training never stop; these tests run
# (and must fail, strict) until scripts/install_tiny.py installs weights trained on
# chat turns that end with EOS, and then must pass.
chat_trained = pytest.mark.xfail(
    not _trained_for_chat(),
    reason="the bundled ssmserve-bamba-tiny predates chat training (its training_report.json "
    "lists no chat data); install the retrained weights with scripts/install_tiny.py",
    strict=True,
)


def chat_prompts() -> list[list[dict]]:
    data = resources.files("ssmserve").joinpath("model_data", "heldout_prompts.json")
    return [p["messages"] for p in json.loads(data.read_text(encoding="utf-8"))["chat"]]


# Most replies must stop by themselves (the model before chat training stopped on none of
# them). Not all: a 7.8 M-parameter model sometimes loops on a phrase of a request it
# never saw; the README's figure is the same measure over 64 prompts.
MIN_STOP_FRACTION = 0.75


@chat_trained
def test_chat_replies_to_heldout_prompts_end_with_eos():
    """Greedy replies with the folder's sampling defaults (what `ssmserve serve` uses) to
    16 held-out write requests: at least 3 in 4 end with EOS within CHAT_MAX_TOKENS,
    and where they do, transformers' greedy generate() with the same penalty ends with
    EOS at the same place, with the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ssmserve import LLM

    path = bundled_path("ssmserve-bamba-tiny")
    conversations = chat_prompts()
    assert len(conversations) == 16
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    params = llm.get_default_sampling_params()
    params.temperature, params.max_tokens = 0, CHAT_MAX_TOKENS
    outputs = llm.chat(conversations, params, use_tqdm=False)
    stopped = [o for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= MIN_STOP_FRACTION * len(outputs), [
        o.outputs[0].text for o in outputs if o.outputs[0].finish_reason != "stop"
    ]

    # The stop is the model's own choice.
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    for output in stopped[:2]:
        reply = hf_greedy(
            model, output.prompt_token_ids, CHAT_MAX_TOKENS, eos, params.repetition_penalty
        )
        assert reply[-1] == eos, output.prompt
        assert strip_eos(list(output.outputs[0].token_ids), eos) == reply[:-1]


@chat_trained
def test_default_sampling_params_are_the_folders_and_match_transformers_penalty():
    """The bundled generation_config.json's repetition penalty is what LLM (and the
    server) use for fields left unset, and greedy replies with it equal transformers'
    greedy generate() with the same penalty (prompt and output tokens penalised), while
    differing from the unpenalised replies."""
    from transformers import AutoModelForCausalLM

    from ssmserve import LLM, SamplingParams

    path = bundled_path("ssmserve-bamba-tiny")
    folder_penalty = json.loads((path / "generation_config.json").read_text())["repetition_penalty"]
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    params = llm.get_default_sampling_params()
    assert params.repetition_penalty == folder_penalty != 1.0
    params.temperature, params.max_tokens = 0, 64
    conversations = chat_prompts()[:2]
    outputs = llm.chat(conversations, params)
    plain = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=64))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    for output in outputs:
        reply = strip_eos(hf_greedy(model, output.prompt_token_ids, 64, eos, folder_penalty), eos)
        assert strip_eos(list(output.outputs[0].token_ids), eos) == reply
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


@chat_trained
def test_served_chat_without_max_tokens_stops_by_itself():
    import httpx

    from ssmserve.config import EngineConfig
    from ssmserve.engine.engine import LLMEngine
    from ssmserve.server.app import build_app
    from ssmserve.server.async_engine import AsyncLLMEngine
    from tests.server.conftest import ServerThread

    path = bundled_path("ssmserve-bamba-tiny")
    # A short context bounds the time a reply that never stops can take.
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=512)
    app = build_app(AsyncLLMEngine(LLMEngine(config)), "ssmserve-bamba-tiny")
    # The README's chat example, with the model's defaults for everything but temperature.
    messages = [{"role": "user", "content": README_CHAT_PROMPT}]
    with ServerThread(app) as server:
        body = {"model": "ssmserve-bamba-tiny", "messages": messages, "temperature": 0}
        response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["choices"][0]["finish_reason"] == "stop", payload["choices"][0]
    assert payload["usage"]["completion_tokens"] < CHAT_MAX_TOKENS
