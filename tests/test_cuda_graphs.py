"""CUDA-graph decode equals eager decode (GPU only; skipped where there is no CUDA)."""

from __future__ import annotations

import pytest
import torch

from ssmserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("variant", ["bamba", "mamba2", "mamba", "llama"])
def test_graph_decode_equals_eager_decode(checkpoint, variant):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 30, 12, 5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8, cache_memory=2**28)
    eager = LLM(checkpoint(variant), enforce_eager=True, **kwargs).generate(prompts, params)
    llm = LLM(checkpoint(variant), **kwargs)
    assert llm.llm_engine.executor.runner.graphs is not None
    graphed = llm.generate(prompts, params)
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for i, t in enumerate(a.outputs[0].token_ids):
            assert (
                abs(a.outputs[0].logprobs[i][t].logprob - b.outputs[0].logprobs[i][t].logprob)
                < 1e-3
            )
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs an sm_90 GPU",
)
@pytest.mark.parametrize("variant", ["mamba2", "bamba", "llama", "mamba"])
def test_pdl_graph_decode_equals_plain_graph_decode(checkpoint, variant):
    """Decode with PDL (the default on sm_90: one-row linears through the GEMV, the
    kernels launched with programmatic dependent launch, captured in CUDA graphs) gives
    the tokens of the plain graphs, one sequence at a time and five together."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 30, 12, 5)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8, cache_memory=2**28)
    plain = LLM(checkpoint(variant), decode_pdl=False, **kwargs)
    pdl = LLM(checkpoint(variant), **kwargs)  # the default: on where it can run
    assert pdl.llm_engine.executor.runner.ops.pdl
    assert not plain.llm_engine.executor.runner.ops.pdl
    for batch in ([[p] for p in prompts[:2]], [prompts]):
        for group in batch:
            a_out, b_out = plain.generate(group, params), pdl.generate(group, params)
            for a, b in zip(a_out, b_out):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                for i, t in enumerate(a.outputs[0].token_ids):
                    got, want = b.outputs[0].logprobs[i][t].logprob, a.outputs[0].logprobs[i][t]
                    assert abs(got - want.logprob) < 1e-3


def _twin_kwargs(**overrides) -> dict:
    """Engine arguments of a GPU run checked against the CPU twins (float32, torch ops);
    each prompt is prefilled whole (prefix caching would hold back its last token)."""
    common = dict(dtype="float32", max_model_len=2048, cache_memory=2**28)
    return dict(common, kernel_backend="torch", enable_prefix_caching=False, **overrides)


def _assert_same_as_twins(cpu, gpu) -> None:
    """Every prompt token's logprob within 2e-3 of the CPU run's, the same greedy tokens."""
    for a, b in zip(cpu, gpu):
        tokens = a.prompt_token_ids
        for i in range(1, len(tokens)):
            want = a.prompt_logprobs[i][tokens[i]].logprob
            assert abs(want - b.prompt_logprobs[i][tokens[i]].logprob) < 2e-3, i
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("variant", ["bamba", "llama"])
def test_fused_prefill_attention_equals_cpu_paged(checkpoint, variant, monkeypatch):
    """Long fresh prompts take PyTorch's fused attention on the GPU, the others the paged
    kernel, in runs between them: the same logprobs as the CPU twins (paged path only)."""
    from ssmserve.layers.attention import FUSED_PREFILL_MIN_TOKENS, Attention

    long_len = FUSED_PREFILL_MIN_TOKENS + 37
    prompts = [
        {"prompt_token_ids": [3 + (7 * i + n) % 250 for i in range(n)]}
        for n in (long_len, 5, long_len + 200, 40)
    ]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    kwargs = _twin_kwargs(max_num_seqs=8, max_num_batched_tokens=4096)
    cpu = LLM(checkpoint(variant), device="cpu", **kwargs).generate(prompts, params)
    fused_lengths = []
    fused = Attention._fused_causal
    monkeypatch.setattr(
        Attention,
        "_fused_causal",
        lambda self, q, k, v: (fused_lengths.append(q.shape[0]), fused(self, q, k, v))[1],
    )
    gpu = LLM(checkpoint(variant), device="cuda", enforce_eager=True, **kwargs).generate(
        prompts, params
    )
    # Each long prompt went through the fused path once per attention layer.
    assert sorted(set(fused_lengths)) == [long_len, long_len + 200]
    _assert_same_as_twins(cpu, gpu)


@pytest.mark.parametrize("variant", ["bamba", "llama"])
def test_fused_prefill_attention_with_cached_context_equals_cpu_paged(
    checkpoint, variant, monkeypatch
):
    """A long prompt in chunks: the first attends to itself, the later ones to their K/V
    gathered from the cache under a lower-right causal mask (fused, a few KV heads at a
    time), the short chunk through the paged kernel: the CPU twins' logprobs."""
    from ssmserve.layers import attention as attention_module
    from ssmserve.layers.attention import FUSED_PREFILL_MIN_TOKENS, Attention

    chunk = FUSED_PREFILL_MIN_TOKENS + 40
    n = 2 * chunk + 100  # chunks of chunk, chunk (cached context) and 100 tokens
    prompts = [{"prompt_token_ids": [3 + (5 * i) % 250 for i in range(n)]}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    kwargs = _twin_kwargs(max_num_seqs=4, max_num_batched_tokens=chunk)
    cpu = LLM(checkpoint(variant), device="cpu", **kwargs).generate(prompts, params)
    contexts = []
    fused = Attention._fused_with_context
    monkeypatch.setattr(
        Attention,
        "_fused_with_context",
        lambda self, q, cache, table, m: (
            contexts.append(m - q.shape[0]),
            fused(self, q, cache, table, m),
        )[1],
    )
    monkeypatch.setattr(attention_module, "FUSED_CONTEXT_MAX_BYTES", 1)  # a KV head a call
    gpu = LLM(checkpoint(variant), device="cuda", enforce_eager=True, **kwargs).generate(
        prompts, params
    )
    assert sorted(set(contexts)) == [chunk]
    _assert_same_as_twins(cpu, gpu)


@pytest.mark.parametrize("variant", ["bamba", "mamba2", "mamba", "llama"])
def test_prefix_caching_with_graphs_equals_uncached_eager(checkpoint, variant):
    """Cache copies run outside the decode graphs and the Triton scans write the chunk
    snapshots: cached, graphed runs of prompts sharing prefixes (repeats and follow-up
    turns included) equal uncached eager ones."""
    stem = list(range(3, 70))
    prompts = [{"prompt_token_ids": stem[:n] + [7] * k} for n, k in ((67, 0), (40, 5), (67, 0))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8, cache_memory=2**28)
    if variant == "mamba":
        kwargs["prefix_checkpoint_interval"] = 16
    eager = LLM(checkpoint(variant), enforce_eager=True, enable_prefix_caching=False, **kwargs)
    llm = LLM(checkpoint(variant), **kwargs)
    for round_ in range(2):
        for p in prompts:
            a = eager.generate([p], params)[0].outputs[0]
            b = llm.generate([p], params)[0].outputs[0]
            assert a.token_ids == b.token_ids, (round_, p)
            for i, t in enumerate(a.token_ids):
                assert abs(a.logprobs[i][t].logprob - b.logprobs[i][t].logprob) < 1e-3
        follow = {"prompt_token_ids": stem + b.token_ids + [9, 9]}
        assert (
            eager.generate([follow], params)[0].outputs[0].token_ids
            == llm.generate([follow], params)[0].outputs[0].token_ids
        )
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


@pytest.mark.parametrize("variant", ["bamba", "mamba"])
def test_stochastic_rounding_under_graphs_equals_eager(checkpoint, variant):
    """The rounding noise comes from the positions the graph reads, so replays draw the
    same noise eager steps draw (a seed frozen into the capture would not), and it is on:
    the logprobs are not those of rounding to nearest."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 30, 12)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=0)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8, cache_memory=2**28)
    kwargs.update(mamba_ssm_cache_dtype="bfloat16", enable_prefix_caching=False)
    sr = dict(mamba_ssm_stochastic_rounding=True)
    eager = LLM(checkpoint(variant), enforce_eager=True, **kwargs, **sr).generate(prompts, params)
    graphed = LLM(checkpoint(variant), **kwargs, **sr).generate(prompts, params)
    nearest = LLM(checkpoint(variant), **kwargs).generate(prompts, params)

    def logprobs(outs):
        return [
            [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in outs
        ]

    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    for a, b in zip(logprobs(eager), logprobs(graphed)):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
    assert logprobs(graphed) != logprobs(nearest)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sampler_draw_gives_the_tensor_ops_tokens_through_the_engine(
    checkpoint, monkeypatch, temperature
):
    """On the GPU the sampler draws plain rows (all greedy, or all from the engine's
    generator at a temperature; no logprobs asked) in two launches (kernels/sampling.py):
    through the engine, with graphs and the overlapped loop, the tokens the tensor ops
    draw from the same seed, and the same cumulative logprob within 1e-3."""
    from ssmserve.engine import sampler

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 30, 12, 5)]
    params = SamplingParams(max_tokens=24, temperature=temperature, ignore_eos=True)
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8, cache_memory=2**28, seed=3)
    calls = []
    draw = sampler.draw_triton

    def counted(*args):
        calls.append(args[1] is not None)
        return draw(*args)

    monkeypatch.setattr(sampler, "draw_triton", counted)
    fused = LLM(checkpoint("bamba"), **kwargs).generate(prompts, params)
    assert calls and all(sampled == (temperature > 0) for sampled in calls)
    monkeypatch.setattr(sampler, "HAS_TRITON", False)  # the tensor ops
    calls.clear()
    ops = LLM(checkpoint("bamba"), **kwargs).generate(prompts, params)
    assert not calls
    for a, b in zip(ops, fused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-3


@pytest.mark.parametrize(("L", "n"), [(300, 300), (300, 1100), (64, 4096), (1, 513)])
def test_cudnn_fused_attention_equals_float64_reference(L, n):
    """16-bit long-prompt attention on sm_90 goes through cuDNN in two parts (the chunk's
    own tokens causally, its context unmasked) merged by logsumexp: each query sees
    exactly the tokens up to its own position, as a float64 softmax says."""
    from ssmserve.layers.attention import _cudnn_usable
    from tests.tiny_models import make_attention

    heads, kv_heads, D = 8, 2, 128
    layer = make_attention(heads, kv_heads, D, scale=0.1)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(m, h, D, generator=gen) for m, h in ((L, heads), (n, kv_heads), (n, kv_heads))
    )
    cuda = [t.to("cuda", torch.bfloat16) for t in (q, k, v)]
    if not _cudnn_usable(cuda[0].transpose(0, 1).unsqueeze(0)):
        pytest.skip("cuDNN attention needs sm_90 and cuDNN")
    out = layer._fused_causal(*cuda).double().cpu()
    q64, k64, v64 = (t.to(torch.bfloat16).double() for t in (q, k, v))
    groups = heads // kv_heads
    for h in range(heads):
        scores = q64[:, h] @ k64[:, h // groups].T * 0.1
        seen = torch.arange(n)[None, :] <= torch.arange(n - L, n)[:, None]
        expected = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v64[:, h // groups]
        assert (out[:, h] - expected).abs().max() < 2e-2, h
