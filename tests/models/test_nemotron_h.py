"""NemotronHForCausalLM against transformers, the engine invariants and TP=1.

Checkpoints (tests/tiny_models.py "nemotron_h", odd shapes):
- grouped: blocks Mamba2, MLP, attention, Mamba2, MLP; 3 norm groups over 6 SSM heads
  (at TP=2 a group spans the two ranks, at TP=3 each rank holds one); MQA.
- biased: attention first and last, 2 norm groups, biases on in/out_proj and the MLP, no
  conv bias, GQA, and time_step_min high enough that its clamp on dt acts.
"""

from __future__ import annotations

import pytest

from ssmserve import LLM
from tests.family_checks import (
    check_engine_invariants,
    check_matches_transformers,
    check_tensor_parallel,
    check_triton_matches_torch,
    tiny_checkpoints,
)
from tests.tiny_models import make_tiny_checkpoint
from tests.triton_interpreter import interpreter_mode

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
}
PROMPTS = ["def hello(name):\n    return", "import os", "x"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "nemotron_h", VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_prompt_logprobs_match_transformers(checkpoint, variant):
    check_matches_transformers(checkpoint(variant), PROMPTS, max_tokens=10)


def test_engine_invariants(checkpoint):
    check_engine_invariants(checkpoint("grouped"), has_attention=True)


@pytest.mark.parametrize(("variant", "size"), [("grouped", 2), ("grouped", 3), ("biased", 2)])
def test_tensor_parallel_equals_tp1(checkpoint, variant, size):
    check_tensor_parallel(checkpoint(variant), PROMPTS, size=size)


def test_moe_blocks_are_refused_with_a_clear_error(tmp_path):
    path = make_tiny_checkpoint(
        str(tmp_path),
        "nemotron_h",
        layers_block_type=["mamba", "moe", "attention"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        moe_shared_expert_intermediate_size=20,
    )
    with pytest.raises(ValueError, match=r"NemotronH MoE blocks are not supported yet.*\[1\]"):
        LLM(path, device="cpu", dtype="float32")


def test_triton_kernels_match_the_torch_twins(checkpoint):
    pytest.importorskip("triton", reason="triton is not installed")
    with interpreter_mode():
        check_triton_matches_torch(checkpoint("grouped"), PROMPTS[:2])
