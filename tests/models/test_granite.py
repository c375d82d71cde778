"""GraniteMoeHybridForCausalLM (Granite 4.0-H) against transformers on tiny checkpoints,
one per layer variant: experts + shared MLP with and without RoPE, and the dense variant
(no experts); µP multipliers differ from 1 in all of them."""

from __future__ import annotations

import pytest
import torch
import transformers

from ssmserve import LLM, SamplingParams
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import get_ops
from ssmserve.models.base import ModelContext
from ssmserve.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from tests.family_checks import (
    check_engine_invariants,
    check_matches_transformers,
    check_tensor_parallel,
)
from tests.tiny_models import make_tiny_checkpoint
from tests.triton_interpreter import interpreter_mode

PROMPTS = ["def hello(name):\n    return", "import os", "x"]
VARIANTS = {
    # mamba2, attention with RoPE, mamba2; 5 experts top-2 + shared MLP
    "moe_rope": {},
    # attention first and last without RoPE, top-3, tied embeddings (scaled so that the
    # model does not just echo its input), 3 KV heads (TP=3)
    "moe_nope_tied": dict(
        layer_types=["attention", "mamba", "attention"],
        position_embedding_type="nope",
        num_key_value_heads=3,
        num_experts_per_tok=3,
        tie_word_embeddings=True,
        embedding_multiplier=0.5,
        residual_multiplier=1.5,
    ),
    # no experts: the shared MLP alone
    "dense": dict(num_local_experts=0, num_experts_per_tok=0, layer_types=["mamba", "attention"]),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            path = str(tmp_path_factory.mktemp(f"granite_{name}"))
            overrides = dict(VARIANTS[name])
            if "layer_types" in overrides:
                overrides["num_hidden_layers"] = len(overrides["layer_types"])
            cache[name] = make_tiny_checkpoint(path, "granitemoehybrid", seed=2, **overrides)
        return cache[name]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(checkpoint, variant):
    check_matches_transformers(checkpoint(variant), PROMPTS, max_tokens=12)


def test_engine_invariants(checkpoint):
    check_engine_invariants(checkpoint("moe_rope"), has_attention=True)


def test_tensor_parallel_2(checkpoint):
    check_tensor_parallel(checkpoint("moe_rope"), PROMPTS[:2], size=2)


def test_tensor_parallel_3(checkpoint):
    check_tensor_parallel(checkpoint("moe_nope_tied"), PROMPTS[:2], size=3)


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
    path = checkpoint("moe_rope")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    ref = LLM(path, device="cpu", kernel_backend="torch").generate(PROMPTS[:2], params)
    with interpreter_mode():
        llm = LLM(path, device="cpu", kernel_backend="triton", max_num_batched_tokens=5)
        got = llm.generate(PROMPTS[:2], params)
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for i, t in enumerate(a.outputs[0].token_ids):
            lp_a, lp_b = a.outputs[0].logprobs[i][t].logprob, b.outputs[0].logprobs[i][t].logprob
            assert abs(lp_a - lp_b) < 1e-4, (i, lp_a, lp_b)
