"""Pipeline parallelism on CPU (gloo): PP=2 and PP=3, alone and with TP=2, equal one
process, for Mamba, Mamba2, Bamba and Llama (Zamba2, whose shared blocks need the
original embeddings sent between stages, is in tests/models/test_zamba2.py). Stages run
their micro-batches in the order they were sent, so several steps are in the pipeline
at once."""

from __future__ import annotations

import time

import pytest

from ssmserve import LLM, SamplingParams
from ssmserve.distributed.executor import WorkerFailedError
from tests.family_checks import assert_idle, check_parallel
from tests.tiny_models import make_tiny_checkpoint

PROMPTS = ["def hello(name):\n    return", "import os", "x", "class Stack:\n    def push(self):"]
CASES = {
    # 3 layers over 2 stages: two Mamba2 layers (no attention) and one attention layer
    # (no SSM layer)
    "bamba_3_layers": ("bamba", dict(num_hidden_layers=3, attn_layer_indices=[2])),
    "bamba": ("bamba", {}),
    "mamba": ("mamba", {}),
    "mamba2": ("mamba2", {}),
    "llama": ("llama", dict(num_hidden_layers=3)),
}


@pytest.fixture(scope="module")
def pp_checkpoint(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            family, overrides = CASES[name]
            path = tmp_path_factory.mktemp(name)
            made[name] = make_tiny_checkpoint(str(path), family, seed=0, **overrides)
        return made[name]

    return get


@pytest.mark.parametrize(
    ("name", "pp", "partition"),
    [
        ("bamba_3_layers", 2, "2,1"),
        ("bamba", 3, None),
        ("mamba", 2, None),
        ("mamba", 3, None),
        ("mamba2", 2, None),
        ("mamba2", 3, None),
        ("llama", 2, None),
        ("llama", 3, None),
    ],
)
def test_pipeline_equals_one_process(pp_checkpoint, name, pp, partition):
    check_parallel(pp_checkpoint(name), PROMPTS, pp=pp, partition=partition)


def test_tp2_by_pp2_equals_one_process(pp_checkpoint):
    check_parallel(pp_checkpoint("bamba_3_layers"), PROMPTS[:3], tp=2, pp=2)


def test_pipeline_with_preemption_sampling_abort_frees_everything(pp_checkpoint):
    path = pp_checkpoint("bamba_3_layers")
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=5)
    ref_llm = LLM(path, device="cpu")
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(PROMPTS, greedy)]
    ref_sampled = [[c.token_ids for c in o.outputs] for o in ref_llm.generate(PROMPTS[:2], sampled)]
    # 10 KV blocks of 4 tokens cannot hold four sequences at once: preemption under PP.
    llm = LLM(
        path,
        device="cpu",
        pipeline_parallel_size=2,
        pp_layer_partition="2,1",
        max_num_batched_tokens=3,
        num_kv_blocks=10,
        block_size=4,
    )
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == ref
        assert llm.stats()["num_preemptions"] > 0
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[:2], sampled)]
        assert got == ref_sampled
        engine = llm.llm_engine
        engine.add_request("doomed", PROMPTS[3], greedy)
        engine.add_request("kept", PROMPTS[0], greedy)
        most_in_flight = 0
        for _ in range(4):
            engine.step()
            most_in_flight = max(most_in_flight, len(engine._in_flight))
        engine.abort_request("doomed")
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        # Both stages had work: two micro-batches were in the pipeline at once.
        assert most_in_flight == 2
        assert done["kept"].outputs[0].token_ids == ref[0]
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_a_dead_stage_fails_requests_and_shutdown_leaves_no_process(pp_checkpoint):
    llm = LLM(pp_checkpoint("llama"), device="cpu", pipeline_parallel_size=3)
    engine = llm.llm_engine
    workers = engine.executor.workers
    try:
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        workers[-1].kill()  # the last stage
        start = time.monotonic()
        with pytest.raises(WorkerFailedError):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        start = time.monotonic()
        engine.shutdown()
    # The stages left wait on the dead one and no exit message reaches them: shutdown
    # stops them at once rather than waiting for them to leave (10 s each, before).
    assert time.monotonic() - start < 5
    assert all(w.poll() is not None for w in workers)


def test_bad_layer_partition_is_refused_before_any_worker_starts(pp_checkpoint):
    with pytest.raises(ValueError, match="must give 2 positive layer counts"):
        LLM(
            pp_checkpoint("llama"), device="cpu", pipeline_parallel_size=2, pp_layer_partition="2,2"
        )
