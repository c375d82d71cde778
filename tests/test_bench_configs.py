"""benchmarks/configs/: the real-size configs build the published model sizes, and a folder
holding only config.json runs with random weights without the hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from ssmserve.bench.floors import DevicePeaks, floor_s, meta_model, model_costs
from ssmserve.config import EngineConfig, ModelConfig, bundled_model_path
from ssmserve.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
H200 = DevicePeaks("NVIDIA H200", 4.25e12, 783e12, "DESIGN.md")

# Parameter counts as their model cards give them, and the architecture.
PUBLISHED = {
    "bamba-9b": ("BambaForCausalLM", 9.78e9),
    "llama-3-8b": ("LlamaForCausalLM", 8.03e9),
    "mamba2-2.7b": ("Mamba2ForCausalLM", 2.7e9),
    "mamba-2.8b": ("MambaForCausalLM", 2.8e9),
    "codestral-mamba-7b": ("Mamba2ForCausalLM", 7.3e9),
    "zamba2-7b": ("Zamba2ForCausalLM", 7.4e9),
    "nemotron-h-8b": ("NemotronHForCausalLM", 8.1e9),
    "falcon-h1-7b": ("FalconH1ForCausalLM", 7.6e9),
    "jamba-mini-1.7": ("JambaForCausalLM", 52e9),
    "granite-4.0-h-tiny": ("GraniteMoeHybridForCausalLM", 7e9),
    "nemotron-3-nano-30b-a3b": ("NemotronHForCausalLM", 31.6e9),
}


def _meta_models(name: str):
    """ssmserve's and transformers' models of a config, on the meta device (no memory)."""
    config = ModelConfig.from_hf(str(CONFIGS / name))
    ours = meta_model(config, torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(config.hf_config)
    finally:
        torch.set_default_dtype(default)
    return config, ours, theirs


def test_every_config_folder_is_listed():
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_builds_the_published_size(name):
    arch, published = PUBLISHED[name]
    config, ours, theirs = _meta_models(name)
    assert config.architecture == arch
    count = sum(p.numel() for p in ours.parameters())
    # transformers keeps Nemotron-H's score-correction biases (checkpoint tensors) as buffers.
    biases = [b for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias")]
    assert count == sum(p.numel() for p in theirs.parameters()) + sum(b.numel() for b in biases)
    assert count == pytest.approx(published, rel=0.02)


def test_bamba_9b_floors_match_the_published_ones():
    config, model, _ = _meta_models("bamba-9b")
    costs = model_costs(model, config.hf_config, torch.bfloat16, torch.float32, 16)
    # DESIGN.md: 18.5 GB of weights read per decode step, so no faster than ~4.4 ms at batch 1.
    assert costs.weight_bytes == pytest.approx(18.5e9, rel=0.01)
    at_2k = floor_s(H200, costs.decode_step_bytes(1, 2048), costs.decode_step_flops(1, 2048))
    assert at_2k == pytest.approx(4.4e-3, rel=0.02)
    # Issue 16: batch 256 at ~1.5k context moves 18.5 GB weights + 62 GB fp32 state read
    # and written + 4.7 GB KV, about 20 ms.
    state = 256 * 2 * costs.state_bytes_per_seq
    kv = 256 * 1536 * costs.kv_bytes_per_token
    assert state == pytest.approx(62e9, rel=0.02) and kv == pytest.approx(4.7e9, rel=0.03)
    at_256 = floor_s(H200, costs.decode_step_bytes(256, 1536), costs.decode_step_flops(256, 1536))
    assert at_256 == pytest.approx(20e-3, rel=0.03)


def test_moe_floors_read_only_the_routed_experts():
    config, model, _ = _meta_models("jamba-mini-1.7")
    cfg = config.hf_config
    costs = model_costs(model, cfg, torch.bfloat16, torch.float32, 16)
    one_expert = 3 * cfg.hidden_size * cfg.intermediate_size * 2  # gate, up, down in bf16
    moe_layers = cfg.num_hidden_layers // cfg.expert_layer_period
    idle = moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * one_expert
    assert costs.weights_read_bytes(1) == pytest.approx(costs.weight_bytes - idle)
    assert costs.weights_read_bytes(8192) == pytest.approx(costs.weight_bytes)
    # The model card: 12B active parameters (of 52B), embedding and LM head included.
    assert costs.active_body_params() + 2 * costs.head_params == pytest.approx(12e9, rel=0.02)


def test_nemotron_3_nano_activates_its_published_share():
    config, model, _ = _meta_models("nemotron-3-nano-30b-a3b")
    costs = model_costs(model, config.hf_config, torch.bfloat16, torch.float32, 16)
    # NVIDIA's announcement: 3.6B active parameters with embeddings (of 31.6B).
    assert costs.active_body_params() + 2 * costs.head_params == pytest.approx(3.6e9, rel=0.02)


def _shrunk_bamba_folder(tmp_path: Path) -> Path:
    """bamba-9b's config.json with small sizes and nothing else in the folder."""
    cfg = json.loads((CONFIGS / "bamba-9b" / "config.json").read_text())
    cfg.update(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=16,
        vocab_size=128256,
        max_position_embeddings=1024,
    )
    folder = tmp_path / "bamba-small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_folder_with_only_config_json_gets_the_bundled_tokenizer_for_dummy_weights(tmp_path):
    folder = _shrunk_bamba_folder(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", device="cpu"))
    bundled = transformers.AutoTokenizer.from_pretrained(bundled_model_path())
    assert engine.tokenizer.get_vocab() == bundled.get_vocab()
    # Ids past the stand-in tokenizer's vocabulary still run (the model's vocabulary rules).
    engine.add_request("r", {"prompt_token_ids": [128000, 5, 60000]}, _greedy(3))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert len(outs[0].outputs[0].token_ids) == 3


def _greedy(n: int):
    from ssmserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_bench_latency_runs_a_config_folder_offline(tmp_path):
    folder = _shrunk_bamba_folder(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "ssmserve.cli", "bench", "latency", "--model", str(folder)]
    cmd += "--load-format dummy --device cpu --batch-size 1 --input-len 16 --output-len 4".split()
    cmd += "--num-iters-warmup 0 --num-iters 2 --disable-tqdm".split()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "BambaForCausalLM" in run.stdout and "random weights" in run.stdout
    assert "| decode step (a token per request)" in run.stdout
    assert "bundled tokenizer stands in" in run.stderr


def test_a_folder_with_its_own_tokenizer_keeps_it_under_dummy_weights(checkpoint):
    path = checkpoint("bamba")
    engine = LLMEngine(EngineConfig(model=path, load_format="dummy", device="cpu"))
    own = transformers.AutoTokenizer.from_pretrained(path)
    assert engine.tokenizer.get_vocab() == own.get_vocab() and len(own) != 4096
