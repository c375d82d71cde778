"""Tensor parallelism on CPU (gloo): TP=2 and TP=3 equal TP=1 for every family.

Each case builds one tiny checkpoint whose shapes hit a sharding rule: Mamba2 groups
that do not divide by the TP size (3 groups over 2 ranks, so ranks hold a group copy per
head), fewer groups than ranks, one KV head (replicated), a vocabulary that does not
divide by the TP size (padded), tied embeddings, channel counts that split unevenly.
The TP engine runs with a tiny token budget and few KV blocks, so chunked prefill and
preemption happen under TP too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ssmserve import LLM, SamplingParams
from ssmserve.distributed.executor import WorkerFailedError
from ssmserve.layers.batch import sampled_rows_read
from tests.server.conftest import ServerProcess, free_port
from tests.tiny_models import make_tiny_checkpoint

CASES = {
    # 3 groups over 2 ranks, MQA, tied embeddings, odd vocabulary
    "bamba_groups3_mqa_tied_tp2": (
        "bamba",
        2,
        dict(
            mamba_n_groups=3,
            mamba_d_state=10,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            vocab_size=389,
        ),
    ),
    # fewer groups (1) than ranks (3), 3 KV heads over 3 ranks, vocab % 3 != 0
    "bamba_tp3": ("bamba", 3, dict(num_key_value_heads=3, vocab_size=386)),
    "mamba2_groups2_tp2": (
        "mamba2",
        2,
        dict(num_heads=6, hidden_size=36, head_dim=12, n_groups=2, vocab_size=385),
    ),
    "mamba_untied_odd_tp2": (
        "mamba",
        2,
        dict(hidden_size=30, state_size=5, tie_word_embeddings=False),
    ),
    # 80 inner channels over 3 ranks: 27 + 27 + 26
    "falcon_mamba_tp3": ("falcon_mamba", 3, {}),
    "llama_tied_tp2": ("llama", 2, dict(tie_word_embeddings=True, vocab_size=387)),
}
PROMPTS = ["def hello(name):\n    return", "import os", "x", "class Stack:\n    def push(self):"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)


def close(a: float, b: float) -> bool:
    """float32 reduction-order noise: all-reduced partial sums round differently from
    one matrix product, by about 1e-6 of the logits' scale."""
    return abs(a - b) <= 1e-5 * max(1.0, abs(a))


def assert_same(ref, got, name):
    for r, g in zip(ref, got, strict=True):
        for rc, gc in zip(r.outputs, g.outputs, strict=True):
            assert gc.token_ids == rc.token_ids, name
            for i, t in enumerate(rc.token_ids):
                assert close(gc.logprobs[i][t].logprob, rc.logprobs[i][t].logprob), (name, i)


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            family, _, overrides = CASES[name]
            path = tmp_path_factory.mktemp(name)
            made[name] = make_tiny_checkpoint(str(path), family, seed=0, **overrides)
        return made[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_tp_equals_tp1_with_chunking_preemption_sampling_and_abort(tp_checkpoint, name):
    family, tp, _ = CASES[name]
    path = tp_checkpoint(name)
    sampled = SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=7, logprobs=0)
    ref_llm = LLM(path, device="cpu")
    ref = ref_llm.generate(PROMPTS, GREEDY)
    ref_sampled = ref_llm.generate(PROMPTS[:2], sampled)
    # A budget of 3 tokens per step splits every prompt; 10 KV blocks of 4 tokens cannot
    # hold four sequences at once, so attention models preempt and recompute.
    kv = dict(num_kv_blocks=10, block_size=4) if family in ("bamba", "llama") else {}
    llm = LLM(path, device="cpu", tensor_parallel_size=tp, max_num_batched_tokens=3, **kv)
    executor = llm.llm_engine.executor
    execute, filled = executor.execute, []

    def spy(packed, tokens=None):
        filled.append(sampled_rows_read(packed) > 0)
        return execute(packed, tokens)

    executor.execute = spy
    try:
        assert_same(ref, llm.generate(PROMPTS, GREEDY), name)
        # Steps were launched before the tokens of the one before came back: their inputs
        # came from rank 0's sampled ids, broadcast to the other ranks.
        assert any(filled)
        if kv:
            assert llm.stats()["num_preemptions"] > 0
        assert_same(ref_sampled, llm.generate(PROMPTS[:2], sampled), name + " sampled")
        engine = llm.llm_engine
        engine.add_request("doomed", PROMPTS[3], GREEDY)
        engine.add_request("kept", PROMPTS[0], GREEDY)
        for _ in range(4):
            engine.step()
        engine.abort_request("doomed")
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done["kept"].outputs[0].token_ids == ref[0].outputs[0].token_ids
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    finally:
        llm.llm_engine.shutdown()


def test_invalid_head_split_names_valid_sizes(tp_checkpoint):
    path = tp_checkpoint("llama_tied_tp2")  # 6 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"num_attention_heads = 6 .* 1, 2, 3, 6"):
        LLM(path, device="cpu", tensor_parallel_size=4)


def test_killed_worker_fails_requests_within_seconds(tp_checkpoint):
    llm = LLM(tp_checkpoint("llama_tied_tp2"), device="cpu", tensor_parallel_size=2)
    engine = llm.llm_engine
    worker = engine.executor.workers[0]
    try:
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        worker.kill()
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="worker"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        engine.shutdown()
    assert worker.poll() is not None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _serve_tp2(path: str) -> tuple[subprocess.Popen, str]:
    server = ServerProcess(path, "--tensor-parallel-size", "2")
    return server.proc, server.base_url


def _complete(base: str, max_tokens: int = 6):
    client = openai.OpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0)
    model = client.models.list().data[0].id
    return client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0
    )


def test_server_with_tp2_serves_openai_client_and_sigterm_stops_every_process(tp_checkpoint):
    proc, base = _serve_tp2(tp_checkpoint("llama_tied_tp2"))
    try:
        workers = _children(proc.pid)
        assert workers, "no tensor-parallel worker process"
        assert _complete(base).usage.completion_tokens == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_reports_a_dead_worker_on_health_and_fails_requests(tp_checkpoint):
    proc, base = _serve_tp2(tp_checkpoint("llama_tied_tp2"))
    try:
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            _complete(base)
        assert httpx.get(base + "/health", timeout=5).status_code == 503
    finally:
        proc.kill()
        proc.wait()


def test_torchrun_ranks_serve_one_engine_like_the_single_process_one(tp_checkpoint):
    path = tp_checkpoint("llama_tied_tp2")
    args = [
        "-m",
        "ssmserve.cli",
        "generate",
        "--model",
        path,
        "--device",
        "cpu",
        "--max-tokens",
        "8",
        PROMPTS[1],
    ]
    alone = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    both = subprocess.run(
        [*torchrun, *args, "--tensor-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert both.returncode == 0, both.stderr
    assert alone.stdout.strip() and both.stdout.strip().endswith(alone.stdout.strip())
