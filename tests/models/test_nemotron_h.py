"""NemotronHForCausalLM against transformers, the engine invariants and TP=1.

Checkpoints (tests/tiny_models.py "nemotron_h", odd shapes):
- grouped: blocks Mamba2, MLP, attention, Mamba2, MLP; 3 norm groups over 6 SSM heads
  (at TP=2 a group spans the two ranks, at TP=3 each rank holds one); MQA.
- biased: attention first and last, 2 norm groups, biases on in/out_proj and the MLP, no
  conv bias, GQA, and time_step_min high enough that its clamp on dt acts.
- moe: Mamba2, MoE, attention, MLP, MoE; 9 experts in 3 groups, the best 2 groups kept,
  top-3, renormalised, routed_scaling_factor 1.7.
- moe_latent: MoE, attention, Mamba2, MoE; 10 experts in 5 groups of 2, the best 3 kept,
  top-3, not renormalised, routed_scaling_factor 2.5, experts in a 24-wide latent space,
  biases on the shared expert and the latent projections.
Each MoE layer has random score-correction biases and one expert that no token reaches.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ssmserve import LLM
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import get_ops
from ssmserve.layers.moe import select_experts
from ssmserve.models.base import ModelContext
from ssmserve.models.nemotron_h import NemotronHForCausalLM, moe_routing
from tests.family_checks import (
    check_engine_invariants,
    check_matches_transformers,
    check_tensor_parallel,
    check_triton_matches_torch,
    tiny_checkpoints,
)
from tests.triton_interpreter import interpreter_mode

MOE = dict(
    layers_block_type=["mamba", "moe", "attention", "mlp", "moe"],
    n_routed_experts=9,
    num_experts_per_tok=3,
    n_group=3,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=1.7,
    moe_intermediate_size=20,
    moe_shared_expert_intermediate_size=28,
)
VARIANTS: dict[str, dict] = {
    "grouped": dict(vocab_size=389),
    "biased": dict(
        layers_block_type=["attention", "mamba", "mlp", "mamba", "attention"],
        n_groups=2,
        num_key_value_heads=2,
        use_bias=True,
        mlp_bias=True,
        use_conv_bias=False,
        time_step_min=0.05,
        time_step_max=0.2,
        hidden_size=42,
        intermediate_size=66,
    ),
    "moe": MOE,
    "moe_latent": dict(
        MOE,
        layers_block_type=["moe", "attention", "mamba", "moe"],
        hidden_size=44,
        n_routed_experts=10,
        n_group=5,
        topk_group=3,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        moe_intermediate_size=12,
        moe_shared_expert_intermediate_size=36,
        moe_latent_size=24,
        mlp_bias=True,
    ),
}
PROMPTS = ["def hello(name):\n    return", "import os", "x"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "nemotron_h", VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_prompt_logprobs_match_transformers(checkpoint, variant):
    check_matches_transformers(checkpoint(variant), PROMPTS, max_tokens=10)


@pytest.mark.parametrize("variant", ["grouped", "moe"])
def test_engine_invariants(checkpoint, variant):
    check_engine_invariants(checkpoint(variant), has_attention=True)


@pytest.mark.parametrize(
    ("variant", "size"),
    [("grouped", 2), ("grouped", 3), ("biased", 2), ("moe", 3), ("moe_latent", 2)],
)
def test_tensor_parallel_equals_tp1(checkpoint, variant, size):
    check_tensor_parallel(checkpoint(variant), PROMPTS, size=size)


def naive_grouped_top_k(logits: list[float], bias: list[float], cfg) -> dict[int, float]:
    """One token's chosen experts -> weights, from the config's fields by sorting floats:
    sigmoid scores; with the bias added, a group scores the sum of its best two; the
    best topk_group groups are kept and the top-k of their experts chosen; weights are
    the scores without the bias, renormalised if norm_topk_prob, times the scale."""
    scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s + b for s, b in zip(scores, bias, strict=True)]
    per = len(logits) // cfg.n_group
    groups = [list(range(g * per, (g + 1) * per)) for g in range(cfg.n_group)]
    group_score = [sum(sorted((choice[e] for e in g), reverse=True)[:2]) for g in groups]
    kept = sorted(range(cfg.n_group), key=lambda g: -group_score[g])[: cfg.topk_group]
    allowed = [e for g in kept for e in groups[g]]
    chosen = sorted(allowed, key=lambda e: -choice[e])[: cfg.num_experts_per_tok]
    total = sum(scores[e] for e in chosen) if cfg.norm_topk_prob else 1.0
    return {e: scores[e] / total * cfg.routed_scaling_factor for e in chosen}


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_top_k_matches_a_naive_loop_and_transformers_router(norm_topk_prob):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    cfg = NemotronHConfig(
        hidden_size=20,
        layers_block_type=["moe"],
        n_routed_experts=9,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=1.7,
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 20, generator=gen)
    weight = torch.randn(9, 20, generator=gen) / 20**0.5
    bias = torch.randn(9, generator=gen) * 0.2
    bias[4] = -3.0  # expert 4 never wins
    weights, ids = select_experts(F.linear(x, weight), moe_routing(cfg), bias)

    logits = F.linear(x, weight).tolist()
    grouping_mattered = 0
    for t in range(x.shape[0]):
        ref = naive_grouped_top_k(logits[t], bias.tolist(), cfg)
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert sorted(got) == sorted(ref), t
        assert [got[e] for e in ref] == pytest.approx(list(ref.values()), rel=1e-6), t
        choice = [1 / (1 + math.exp(-v)) + b for v, b in zip(logits[t], bias.tolist())]
        ungrouped = sorted(range(9), key=lambda e: -choice[e])[:3]
        grouping_mattered += sorted(ungrouped) != sorted(ref)
    assert grouping_mattered >= 5, "the groups should change some tokens' choices"
    loads = torch.bincount(ids.flatten(), minlength=9)
    assert loads[4] == 0 and (loads[torch.arange(9) != 4] > 0).all(), loads

    router = NemotronHTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    _, hf_weights, hf_ids = router(x)
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )


def _without(source: str, dest, key: str) -> str:
    for name in os.listdir(source):
        if name != "model.safetensors":
            os.symlink(os.path.join(source, name), dest / name)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    del tensors[key]
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return str(dest)


@pytest.mark.parametrize(
    "key",
    ["backbone.layers.4.mixer.experts.8.up_proj.weight", "backbone.layers.1.mixer.gate.weight"],
)
def test_a_missing_moe_tensor_is_named_as_in_the_checkpoint(checkpoint, tmp_path, key):
    path = _without(checkpoint("moe"), tmp_path, key)
    with pytest.raises(ValueError, match=rf"missing from the checkpoint: {key}"):
        LLM(path, device="cpu", dtype="float32")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(mlp_hidden_act="tanh"), r"expert activation \('tanh'\) is not supported"),
        (dict(n_group=2), r"n_group = 2 must divide the 9 experts"),
        (dict(topk_group=1), r"topk_group = 1 groups of 3 experts hold fewer than .* = 4"),
    ],
)
def test_unsupported_moe_settings_are_refused_with_a_clear_error(override, message):
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(**dict(MOE, hidden_size=48, num_experts_per_tok=4, **override))
    ctx = ModelContext(ops=get_ops("torch", "cpu"), tp=TensorParallel())
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        NemotronHForCausalLM(cfg, ctx)


@pytest.mark.parametrize("variant", ["grouped", "moe"])
def test_triton_kernels_match_the_torch_twins(checkpoint, variant):
    pytest.importorskip("triton", reason="triton is not installed")
    with interpreter_mode():
        check_triton_matches_torch(checkpoint(variant), PROMPTS[:2])
