"""FalconH1ForCausalLM against transformers, the engine invariants and TP=1.

Every checkpoint has µP multipliers away from 1 (tests/tiny_models.py "falcon_h1"), an
SSM width (mamba_d_ssm) other than mamba_expand * hidden_size and an attention head_dim
other than hidden_size / num_attention_heads:
- gate_then_norm: grouped RMSNorm of x * silu(z) (3 groups over 6 SSM heads: at TP=2 a
  group spans the two ranks), GQA.
- norm_then_gate: RMSNorm before the gate, 2 groups (at TP=3 a group spans ranks), MQA.
- no_norm: no SSM norm (x * silu(z) only), every bias on, tied embeddings, a finite
  time_step_limit.
"""

from __future__ import annotations

import pytest

from tests.family_checks import (
    check_engine_invariants,
    check_matches_transformers,
    check_tensor_parallel,
    check_triton_matches_torch,
    tiny_checkpoints,
)
from tests.triton_interpreter import interpreter_mode

VARIANTS: dict[str, dict] = {
    "gate_then_norm": dict(vocab_size=389),
    "norm_then_gate": dict(
        mamba_norm_before_gate=True, mamba_n_groups=2, num_key_value_heads=1, vocab_size=386
    ),
    "no_norm": dict(
        mamba_rms_norm=False,
        mamba_n_groups=1,
        attention_bias=True,
        mlp_bias=True,
        mamba_proj_bias=True,
        projectors_bias=True,
        tie_word_embeddings=True,
        time_step_limit=[0.01, 0.08],
    ),
}
PROMPTS = ["def hello(name):\n    return", "import os", "x"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "falcon_h1", VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_prompt_logprobs_match_transformers(checkpoint, variant):
    check_matches_transformers(checkpoint(variant), PROMPTS, max_tokens=10)


def test_engine_invariants(checkpoint):
    check_engine_invariants(checkpoint("gate_then_norm"), has_attention=True)


@pytest.mark.parametrize(
    ("variant", "size"),
    [("gate_then_norm", 2), ("norm_then_gate", 3), ("no_norm", 2)],
)
def test_tensor_parallel_equals_tp1(checkpoint, variant, size):
    check_tensor_parallel(checkpoint(variant), PROMPTS, size=size)


def test_triton_kernels_match_the_torch_twins(checkpoint):
    pytest.importorskip("triton", reason="triton is not installed")
    with interpreter_mode():
        check_triton_matches_torch(checkpoint("norm_then_gate"), PROMPTS[:2])
