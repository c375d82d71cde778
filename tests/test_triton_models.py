"""Whole models through the Triton kernels give the same greedy tokens as through the
PyTorch twins (float32), with chunked prefill, decode and a batch: compiled on a CUDA GPU,
in the interpreter (TRITON_INTERPRET=1) on a machine without one."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from ssmserve import LLM, SamplingParams
from ssmserve.kernels._common import record_compile_keys
from tests.triton_interpreter import interpreter_mode

pytest.importorskip("triton", reason="triton is not installed")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    """Without a GPU the models run on the CPU, so their Triton kernels run in the
    interpreter; with one they compile (and the interpreter is left alone)."""
    with interpreter_mode() if DEVICE == "cpu" else contextlib.nullcontext():
        yield


CASES = {
    # variant: (prompts, max_tokens); Mamba1's scan is slow in the interpreter: keep it short
    "bamba": (["def hello(x):\n    return", "import os"], 6),
    "bamba_attn_first_last_mqa": (["class Foo:", "x"], 4),
    "mamba2_ngroups_odd": (["def hello(x):\n    return", "import os"], 6),
    "llama_mqa_tied": (["def hello(x):\n    return", "import os"], 6),
    "falcon_mamba": (["import os"], 3),
}


def assert_same_greedy_outputs(ref, got) -> None:
    """The same tokens, and each token's logprob within 1e-4."""
    for a, b in zip(ref, got, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb
        for i, t in enumerate(ta):
            assert (
                abs(a.outputs[0].logprobs[i][t].logprob - b.outputs[0].logprobs[i][t].logprob)
                < 1e-4
            )


@pytest.mark.parametrize("variant", list(CASES))
def test_triton_backend_matches_torch_backend(checkpoint, variant):
    prompts, max_tokens = CASES[variant]
    path = checkpoint(variant)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    common = dict(device=DEVICE, dtype="float32", enforce_eager=True, cache_memory=2**28)
    ref = LLM(path, kernel_backend="torch", **common).generate(prompts, params)
    llm = LLM(path, kernel_backend="triton", max_num_batched_tokens=5, **common)
    assert llm.llm_engine.executor.runner.cache_specs
    got = llm.generate(prompts, params)
    assert_same_greedy_outputs(ref, got)


@pytest.mark.parametrize("variant", ["bamba", "llama_mqa_tied"])
def test_decode_gemv_matches_f_linear(checkpoint, variant):
    """decode_gemv="triton": the linears' decode-sized inputs (and the LM head's) run on the
    Triton GEMV, with the same greedy tokens and logprobs as F.linear."""
    prompts, max_tokens = CASES[variant]
    path = checkpoint(variant)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    common = dict(
        device=DEVICE,
        dtype="float32",
        enforce_eager=True,
        cache_memory=2**28,
        kernel_backend="triton",
    )
    ref = LLM(path, **common).generate(prompts, params)
    with record_compile_keys() as keys:
        got = LLM(path, decode_gemv="triton", **common).generate(prompts, params)
    assert "_gemv_kernel" in keys, "the GEMV never ran"
    assert_same_greedy_outputs(ref, got)


@pytest.mark.parametrize("variant", ["bamba", "mamba2", "bamba_ngroups"])
def test_fused_mamba2_decode_gives_the_tokens_of_the_unfused_kernels(
    checkpoint, variant, monkeypatch
):
    """Greedy tokens and logprobs through the fused decode kernel equal those through the
    conv update and state update kernels it replaces (one group and two). One sequence:
    the mixer fuses decode steps of one sequence only (FUSED_DECODE_MAX_ROWS)."""
    from ssmserve.kernels import mamba2_decode
    from ssmserve.kernels.causal_conv1d import causal_conv1d_update_triton
    from ssmserve.kernels.state_update import selective_state_update_triton

    prompts = ["def hello(x):\n    return"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    common = dict(
        device=DEVICE, dtype="float32", enforce_eager=True, cache_memory=2**28,
        kernel_backend="triton",
    )  # fmt: skip
    with record_compile_keys() as fused_keys:
        fused = LLM(checkpoint(variant), **common).generate(prompts, params)
    # The two launches it replaces: the conv outputs go through global memory.
    unfused = functools.partial(
        mamba2_decode.conv_then_state_update,
        causal_conv1d_update_triton,
        selective_state_update_triton,
    )
    monkeypatch.setattr(mamba2_decode, "mamba2_decode_update_triton", unfused)
    with record_compile_keys() as unfused_keys:
        unfused_out = LLM(checkpoint(variant), **common).generate(prompts, params)
    assert "_mamba2_decode_kernel" in fused_keys and "_conv1d_update_kernel" not in fused_keys
    assert "_mamba2_decode_kernel" not in unfused_keys and "_state_update_kernel" in unfused_keys
    assert_same_greedy_outputs(unfused_out, fused)
