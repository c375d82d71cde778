"""Two-batch overlap (engine/cuda_graphs.py, `HalfBatchOverlap`): a decode batch computed
as two halves that take turns at branch ends gives the whole batch's logits and leaves
the same caches, in every family; the halves' turns come in the order the streams'
events assume. On CPU the turns run with no streams (the GPU capture is checked in
tests/test_cuda_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from ssmserve.config import EngineConfig
from ssmserve.engine.cuda_graphs import HalfBatchOverlap, _Turns
from ssmserve.engine.engine import LLMEngine
from ssmserve.layers.batch import ForwardBatch, StepInputs
from tests.tiny_models import make_tiny_checkpoint

FAMILIES = [
    "bamba",
    "mamba2",
    "mamba",
    "llama",
    "zamba2",
    "nemotron_h",
    "falcon_h1",
    "jamba",
    "granitemoehybrid",
]


def _decode_batch(engine: LLMEngine, contexts: list[int]) -> ForwardBatch:
    """One decode step of len(contexts) requests, each with the slot and the KV blocks of
    its context taken from the engine's pools."""
    block_size = engine.config.block_size
    inputs = StepInputs(logits_indices=list(range(len(contexts))), num_decodes=len(contexts))
    for i, context in enumerate(contexts):
        blocks: list[int] = []
        if engine.block_pool is not None:
            blocks = engine.block_pool.allocate(engine.block_pool.blocks_for(context + 1))
        slot = engine.state_pool.allocate() if engine.state_pool is not None else None
        inputs.add_sequence([5 + 3 * i], context, blocks, block_size, slot)
    return ForwardBatch.from_packed(inputs.pack(), engine.device)


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory):
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(family)), family)
        return made[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_overlapped_halves_equal_the_whole_batch(family_checkpoint, family):
    engine = LLMEngine(
        EngineConfig(
            model=family_checkpoint(family),
            device="cpu",
            dtype="float32",
            max_num_seqs=8,
            cache_memory=2**24,
            enable_prefix_caching=False,
        )
    )
    try:
        runner = engine.executor.runner
        gen = torch.Generator().manual_seed(0)
        for _, stack in runner.cache_stacks:
            stack.copy_(0.3 * torch.randn(stack.shape, generator=gen))
        before = [stack.clone() for _, stack in runner.cache_stacks]
        # Odd: the halves differ in size; contexts differ so every row reads its own KV.
        # The tolerance covers GEMMs of other row counts rounding differently.
        batch = _decode_batch(engine, [9, 3, 17, 5, 12])
        whole = runner.forward_logits(batch)
        after_whole = [stack.clone() for _, stack in runner.cache_stacks]
        for (_, stack), saved in zip(runner.cache_stacks, before):
            stack.copy_(saved)
        halves = HalfBatchOverlap(runner).forward_logits(batch)
        torch.testing.assert_close(halves, whole, rtol=1e-4, atol=1e-4)
        for (_, stack), want in zip(runner.cache_stacks, after_whole):
            torch.testing.assert_close(stack, want, rtol=1e-4, atol=1e-4)
        # The step wrote the caches: a check on unchanged caches could not fail.
        assert any(not torch.equal(a, b) for a, b in zip(after_whole, before))
    finally:
        engine.shutdown()


def test_turns_interleave_one_branch_apart(family_checkpoint, monkeypatch):
    """Host order a1 a2 b1 a3 b2 ... aK b(K-1) bK: each wait (B's branch k on A's branch
    k, A's branch k + 2 on B's branch k) comes after the event it waits on is recorded."""
    order: list[tuple[int, int]] = []
    real = _Turns.branch_end

    def recording(self, me):
        order.append((me, len(self.ends[me]) + 1))
        real(self, me)

    monkeypatch.setattr(_Turns, "branch_end", recording)
    engine = LLMEngine(
        EngineConfig(
            model=family_checkpoint("bamba"),
            device="cpu",
            dtype="float32",
            max_num_seqs=4,
            cache_memory=2**24,
            enable_prefix_caching=False,
        )  # fmt: skip
    )
    try:
        HalfBatchOverlap(engine.executor.runner).forward_logits(_decode_batch(engine, [4, 6, 2]))
    finally:
        engine.shutdown()
    branches = len(order) // 2
    # Bamba: a mixer and an MLP in each layer.
    assert branches == 2 * engine.model_config.hf_config.num_hidden_layers
    want = [(0, 1), (0, 2)]
    for k in range(1, branches - 1):
        want += [(1, k), (0, k + 2)]
    want += [(1, branches - 1), (1, branches)]
    assert order == want


def test_an_error_in_either_half_reaches_the_caller(family_checkpoint, monkeypatch):
    engine = LLMEngine(
        EngineConfig(
            model=family_checkpoint("bamba"),
            device="cpu",
            dtype="float32",
            max_num_seqs=4,
            cache_memory=2**24,
            enable_prefix_caching=False,
        )  # fmt: skip
    )
    try:
        runner = engine.executor.runner
        batch = _decode_batch(engine, [4, 6, 2, 3])
        model = runner.model
        real = type(model).compute_logits
        for failing in (0, 1):
            calls = []

            def compute_logits(self, hidden, failing=failing, calls=calls):
                calls.append(hidden.shape[0])
                if len(calls) == failing + 1:
                    raise RuntimeError(f"half {failing} failed")
                return real(self, hidden)

            monkeypatch.setattr(type(model), "compute_logits", compute_logits)
            with pytest.raises(RuntimeError, match=f"half {failing} failed"):
                HalfBatchOverlap(runner).forward_logits(batch)
            assert len(calls) == 2  # the other half ran to its end: no thread left waiting
    finally:
        engine.shutdown()


def test_overlap_min_batch_must_leave_two_rows():
    with pytest.raises(ValueError, match="two_batch_overlap_min_batch"):
        EngineConfig(two_batch_overlap_min_batch=1)
