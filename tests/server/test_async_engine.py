"""AsyncLLMEngine on its own: cumulative outputs, isolation of bad requests, early exits
free the caches, a crashed step loop fails every waiter instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from ssmserve.sampling_params import SamplingParams
from ssmserve.server.async_engine import AsyncLLMEngine, EngineDeadError
from tests.server.conftest import make_engine


async def _wait_idle(async_engine: AsyncLLMEngine, timeout: float = 3.0) -> dict[str, int]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = async_engine.stats()
        busy = stats["num_running"] + stats["num_waiting"] + stats["kv_blocks_used"]
        if busy + stats["state_slots_used"] == 0 or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.01)


def test_generate_isolation_and_early_exit(bamba_checkpoint):
    engine = make_engine(bamba_checkpoint)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = "def fib(n):"

    # The reference, before the step thread owns the engine.
    engine.add_request("ref", prompt, greedy)
    reference = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            reference = out.outputs[0].text
    async_engine = AsyncLLMEngine(engine)

    async def run_good():
        outputs = [out async for out in async_engine.generate("good", prompt, greedy)]
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and lengths[-1] == 12  # cumulative
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        return outputs[-1].outputs[0].text

    async def run_bad():
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in async_engine.generate("bad", "x " * 5000, greedy):
                pass

    async def leave_early():
        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        async for out in async_engine.generate("early", prompt, long):
            if len(out.outputs[0].token_ids) >= 3:
                break  # closing the generator aborts the request

    async def main():
        async_engine.start()
        try:
            text, *_ = await asyncio.gather(run_good(), run_bad(), leave_early())
            stats = await _wait_idle(async_engine)
            assert text == reference
            assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
            assert stats["generation_tokens_total"] < 12 * 2 + 100  # "early" was cut short
        finally:
            await async_engine.shutdown()
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("after", prompt, greedy)

    asyncio.run(main())


def test_step_crash_fails_every_waiter(bamba_checkpoint):
    engine = make_engine(bamba_checkpoint)
    real_step = engine.step

    def crashing_step():
        if engine.stats()["num_running"] + engine.stats()["num_waiting"] >= 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = crashing_step
    async_engine = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def consume(i):
        async for _ in async_engine.generate(str(i), "def", params):
            pass

    async def main():
        async_engine.start()
        results = await asyncio.wait_for(
            asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True), timeout=30
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device lost" in str(results[0])
        with pytest.raises(EngineDeadError):
            await async_engine.add_request("late", "def", params)
        await async_engine.shutdown()

    asyncio.run(main())
