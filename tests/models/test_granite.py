"""GraniteMoeHybridForCausalLM (Granite 4.0-H) against transformers on tiny checkpoints,
one per layer variant: experts + shared MLP with and without RoPE, and the dense variant
(no experts); µP multipliers differ from 1 in all of them."""

from __future__ import annotations

import pytest
import torch
import transformers

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import get_ops
from ssmserve.models.base import ModelContext
from ssmserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from tests.family_checks import (
    check_engine_invariants,
    check_matches_transformers,
    check_parallel,
    check_tensor_parallel,
    check_triton_matches_torch,
    tiny_checkpoints,
)
from tests.triton_interpreter import interpreter_mode

PROMPTS = ["def hello(name):\n    return", "import os", "x"]
VARIANTS = {
    # mamba2, attention with RoPE, mamba2; 5 experts top-2 + shared MLP
    "moe_rope": {},
    # attention first and last without RoPE, top-3, tied embeddings (scaled so that the
    # model does not just echo its input), 3 KV heads (TP=3)
    "moe_nope_tied": dict(
        layer_types=["attention", "mamba", "attention"],
        num_hidden_layers=3,
        position_embedding_type="nope",
        num_key_value_heads=3,
        num_experts_per_tok=3,
        tie_word_embeddings=True,
        embedding_multiplier=0.5,
        residual_multiplier=1.5,
    ),
    # no experts: the shared MLP alone
    "dense": dict(
        num_local_experts=0,
        num_experts_per_tok=0,
        layer_types=["mamba", "attention"],
        num_hidden_layers=2,
    ),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "granitemoehybrid", VARIANTS)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(checkpoint, variant):
    check_matches_transformers(checkpoint(variant), PROMPTS, max_tokens=12)


def test_engine_invariants(checkpoint):
    check_engine_invariants(checkpoint("moe_rope"), has_attention=True)


def test_tensor_parallel_2(checkpoint):
    check_tensor_parallel(checkpoint("moe_rope"), PROMPTS[:2], size=2)


def test_tensor_parallel_3(checkpoint):
    check_tensor_parallel(checkpoint("moe_nope_tied"), PROMPTS[:2], size=3)


def test_pipeline_parallel_2_with_tensor_parallel_2(checkpoint):
    # the embedding multiplier on the first stage, the logits scaling on the last
    check_parallel(checkpoint("moe_rope"), PROMPTS[:2], tp=2, pp=2)


def test_unsupported_position_embedding_is_refused():
    cfg = transformers.GraniteMoeHybridConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        mamba_n_heads=2,
        layer_types=["attention"],
        position_embedding_type="alibi",
    )
    ctx = ModelContext(get_ops("torch", "cpu"), TensorParallel())
    with torch.device("meta"), pytest.raises(ValueError, match="position_embedding_type = 'alibi'"):
        GraniteMoeHybridForCausalLM(cfg, ctx)


def test_triton_kernels_match_the_torch_twins(checkpoint):
    pytest.importorskip("triton", reason="triton is not installed")
    with interpreter_mode():
        check_triton_matches_torch(checkpoint("moe_rope"), PROMPTS[:2])
