"""The Python API end to end (text, token and chat prompts), loading errors, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ssmserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_text_token_and_chat_prompts_agree(checkpoint):
    llm = LLM(checkpoint("bamba"), device="cpu")
    tok = llm.get_tokenizer()
    text = "def main():"
    by_text = llm.generate(text, GREEDY)[0]
    by_ids = llm.generate({"prompt_token_ids": tok(text).input_ids}, GREEDY)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == text and by_text.prompt_token_ids == tok(text).input_ids
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids)

    messages = [{"role": "user", "content": "write a loop"}]
    chat = llm.chat(messages, GREEDY)[0]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    direct = llm.generate(
        {"prompt_token_ids": tok(rendered, add_special_tokens=False).input_ids}, GREEDY
    )[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    two = llm.chat([messages, [{"role": "user", "content": "hi"}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == chat.outputs[0].token_ids


def test_chat_without_template_says_what_to_do(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("mamba2"), tmp_path / "m")
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in path.glob("chat_template.*"):
        extra.unlink()
    llm = LLM(str(path), device="cpu")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_sharded_checkpoint_loads_the_same(checkpoint, tmp_path):
    src = checkpoint("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst = tmp_path / "sharded"
    model.save_pretrained(dst, max_shard_size="20KB")
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(src, name), dst)
    assert (dst / "model.safetensors.index.json").exists()
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    a = LLM(src, device="cpu").generate(prompt, GREEDY)[0].outputs[0].token_ids
    b = LLM(str(dst), device="cpu").generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert a == b


def test_loading_errors_name_the_problem(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        LLM("someone/not-a-cached-model")

    path = shutil.copytree(checkpoint("mamba2"), tmp_path / "arch")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: .*BambaForCausalLM"):
        LLM(str(path))

    path = shutil.copytree(checkpoint("mamba2"), tmp_path / "weights")
    weights = load_file(path / "model.safetensors")
    weights.pop("backbone.norm_f.weight")
    weights["backbone.extra.weight"] = torch.zeros(2)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match="missing from the checkpoint: backbone.norm_f.weight.*"
        "not used by the model: backbone.extra.weight",
    ):
        LLM(str(path))


def test_cli_generate_prints_a_completion(checkpoint):
    path = checkpoint("bamba")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssmserve.cli",
            "generate",
            "--model",
            path,
            "--max-tokens",
            "8",
            "--ignore-eos",
            "hello",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    expected = (
        LLM(path, device="cpu")
        .generate("hello", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    assert proc.stdout == "hello" + expected + "\n"


def test_cli_reports_bad_flags_clearly(checkpoint):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ssmserve.cli",
            "generate",
            "--model",
            checkpoint("bamba"),
            "--temperature",
            "-1",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "temperature must be >= 0" in proc.stderr
