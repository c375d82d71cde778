"""Clients that go away abort their requests: blocks and state slots come back at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from tests.server.conftest import MODEL_NAME, ServerThread, make_engine

MAX_TOKENS = 400
STEP_SECONDS = 0.02


def _assert_idle(metrics: dict[str, float]) -> None:
    assert metrics["ssmserve:num_requests_running"] == 0
    assert metrics["ssmserve:num_requests_waiting"] == 0
    assert metrics["ssmserve:kv_blocks_used"] == 0
    assert metrics["ssmserve:state_slots_used"] == 0
    assert metrics["ssmserve:kv_blocks_total"] > 0 and metrics["ssmserve:state_slots_total"] > 0


def test_eight_clients_disconnect_mid_stream(server):
    server.wait_idle()
    before = server.metrics()["ssmserve:generation_tokens_total"]
    body = {
        "model": MODEL_NAME,
        "prompt": "def fib(n):",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def read_three_chunks_then_leave(http: httpx.AsyncClient, i: int) -> int:
        chat = i % 2 == 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        payload = dict(body)
        if chat:
            payload.pop("prompt")
            payload["messages"] = [{"role": "user", "content": f"request {i}"}]
        seen = 0
        async with http.stream("POST", server.base_url + path, json=payload) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
        return seen

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(read_three_chunks_then_leave(http, i) for i in range(8)))

    assert asyncio.run(main()) == [3] * 8
    metrics = server.wait_idle(timeout=3.0)
    _assert_idle(metrics)
    # They were aborted, not run to the end.
    assert metrics["ssmserve:generation_tokens_total"] - before < 8 * MAX_TOKENS / 2

    # The server still serves.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL_NAME, prompt="def", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    _assert_idle(server.wait_idle())


@pytest.fixture(scope="module")
def slow_server(bamba_checkpoint):
    """A server whose engine takes at least STEP_SECONDS per step, so a request of MAX_TOKENS
    tokens runs for MAX_TOKENS * STEP_SECONDS whatever the machine's speed."""
    engine = make_engine(bamba_checkpoint)
    real_step = engine.step

    def slow_step():
        time.sleep(STEP_SECONDS)
        return real_step()

    engine.step = slow_step
    with ServerThread(build_app(AsyncLLMEngine(engine), MODEL_NAME)) as handle:
        yield handle


def test_non_streaming_client_that_times_out_is_aborted(slow_server):
    server = slow_server
    server.wait_idle()
    before = server.metrics()["ssmserve:generation_tokens_total"]
    body = {
        "model": MODEL_NAME,
        "prompt": "def fib(n):",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }
    for _ in range(2):
        try:
            httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        else:
            raise AssertionError("the request should have outlived the client's timeout")
    # Run to the end, each request would hold its blocks and slot for MAX_TOKENS * STEP_SECONDS
    # (8 s); aborted, they are free within the wait.
    assert MAX_TOKENS * STEP_SECONDS > 3.0
    metrics = server.wait_idle(timeout=3.0)
    _assert_idle(metrics)
    assert metrics["ssmserve:generation_tokens_total"] - before < 2 * MAX_TOKENS / 2
