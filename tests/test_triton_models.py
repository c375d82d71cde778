"""Whole models through the Triton kernels give the same greedy tokens as through the
PyTorch twins (float32), with chunked prefill, decode and a batch: compiled on a CUDA GPU,
in the interpreter (TRITON_INTERPRET=1) on a machine without one."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ssmserve import LLM, SamplingParams
from ssmserve.kernels import _common
from ssmserve.kernels._common import record_compile_keys
from ssmserve.layers.mlp import GatedMLP
from tests.tiny_models import make_tiny_checkpoint
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


@pytest.mark.parametrize("variant", ["bamba", "mamba"])
def test_one_row_gemv_gives_the_tokens_of_f_linear(checkpoint, variant):
    """With the linears of one row through the Triton GEMV (what --decode-pdl runs, here
    without PDL, which needs an sm_90 GPU): the greedy tokens and logprobs of F.linear,
    over a one-token prompt's prefill and the decode steps of one sequence, and every
    linear's weight read by the GEMV. Bamba has every kind of linear: the Mamba2
    projections, attention's, the MLP's (gate_up with act(gate) * up, one launch), the
    LM head; Mamba1 adds x_proj and dt_proj."""
    from ssmserve.kernels.gemv import gemv_act_and_mul_triton, gemv_triton

    prompts = [{"prompt_token_ids": [7]}, "def hello(x):\n    return"]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    common = dict(
        device=DEVICE, dtype="float32", enforce_eager=True, cache_memory=2**28,
        kernel_backend="triton",
    )  # fmt: skip
    llm = LLM(checkpoint(variant), **common)
    ref = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    linears = [
        m for m in llm.llm_engine.executor.runner.model.modules() if hasattr(m, "decode_gemv")
    ]
    assert linears
    read = set()

    def recording_gemv(x, weight, bias=None, **kwargs):  # the LM head's out_dtype
        read.add(weight.data_ptr())
        return gemv_triton(x, weight, bias, **kwargs)

    def recording_gated_gemv(x, weight, bias=None, *, act):
        read.add(weight.data_ptr())
        return gemv_act_and_mul_triton(x, weight, bias, act=act)

    for module in linears:
        module.decode_gemv = recording_gemv
    mlps = [m for m in llm.llm_engine.executor.runner.model.modules() if type(m) is GatedMLP]
    assert bool(mlps) == (variant == "bamba")
    for module in mlps:
        module.decode_gemv_act_and_mul = recording_gated_gemv
    with record_compile_keys() as keys:
        got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert "_gemv_kernel" in keys
    assert {m.weight.data_ptr() for m in linears} <= read
    assert_same_greedy_outputs(ref, got)


class DeviceWork(TorchDispatchMode):
    """Counts the PyTorch ops that launch device work (not views, allocations or ops that
    hand back their input) and the Triton launches: on a GPU each is a kernel launch the
    host pays for, and a batch-1 prefill of a many-layer model is bound by them."""

    ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided"}

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launches = 0
        self.in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_launch and not func.is_view and func._schema.name not in self.ALLOCATIONS:
            inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
            if func._schema.is_mutable or not (isinstance(out, torch.Tensor) and id(out) in inputs):
                self.ops += 1
        return out

    def launch(self, kernel):
        def counted(*args, **kwargs):
            self.launches += 1
            self.in_launch = True  # the interpreter's own tensor work is not the host's
            try:
                return kernel(*args, **kwargs)
            finally:
                self.in_launch = False

        return counted


def forwards_of_one_prompt(llm: LLM, prompt: list[int], monkeypatch) -> list[tuple[int, int, int]]:
    """(tokens, PyTorch ops, Triton launches) of each forward that runs the prompt."""
    runner = llm.llm_engine.executor.runner
    execute, getitem = runner.execute, _common.LazyKernel.__getitem__
    counts, current = [], []

    def counted_execute(packed, *args, **kwargs):
        with DeviceWork() as work:
            current[:] = [work]
            out = execute(packed, *args, **kwargs)
        counts.append((int(packed[0]), work.ops, work.launches))
        return out

    def counted_getitem(kernel, grid):
        launch = getitem(kernel, grid)
        return current[0].launch(launch) if current else launch

    monkeypatch.setattr(runner, "execute", counted_execute)
    monkeypatch.setattr(_common.LazyKernel, "__getitem__", counted_getitem)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("family", ["mamba2", "falcon_mamba"])
def test_prefix_caching_costs_a_few_kernels_per_layer_not_per_checkpoint(
    tmp_path, family, monkeypatch
):
    """A prefill with caching on writes its checkpoints (2 here) with the launches of one
    without (the scans write the SSM states themselves) and two more kernels per SSM layer
    for the conv states, plus a few per step; the prompt takes one step more (its last
    token, so a repeat resumes from the state before it), no more. Before, each layer
    spent about 40 kernels on it at any number of checkpoints: 2.5x the prefill's."""
    num_layers = 3
    path = make_tiny_checkpoint(str(tmp_path), family, seed=0, num_hidden_layers=num_layers)
    prompt = [5 + i % 200 for i in range(2 * 16 + 5)]  # two 16-token intervals and more
    common = dict(
        device=DEVICE, dtype="float32", enforce_eager=True, cache_memory=2**28,
        kernel_backend="triton", prefix_checkpoint_interval=16,
    )  # fmt: skip
    off = forwards_of_one_prompt(
        LLM(path, enable_prefix_caching=False, **common), prompt, monkeypatch
    )
    on = forwards_of_one_prompt(LLM(path, **common), prompt, monkeypatch)
    assert [tokens for tokens, _, _ in off] == [len(prompt), 1]
    assert [tokens for tokens, _, _ in on] == [len(prompt) - 1, 1, 1]
    (_, ops_off, launches_off), (_, ops_on, launches_on) = off[0], on[0]
    assert launches_on == launches_off
    assert ops_on - ops_off <= 2 * num_layers + 8, (ops_off, ops_on)
