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
    assert llm.llm_engine.runner.graphs is not None
    graphed = llm.generate(prompts, params)
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for i, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[i][t].logprob
                       - b.outputs[0].logprobs[i][t].logprob) < 1e-3
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
