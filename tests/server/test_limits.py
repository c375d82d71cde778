"""#18.1: what one request may ask for is bounded, each limit configurable and named in its
400; a failure inside one request fails that request only."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.options import ServerOptions
from tests.server.conftest import MODEL_NAME, ServerThread, make_engine


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"n": 5_000_000}, "n", ["5000000", "128", "--max-n"]),
        ({"n": 129}, "n", ["128", "--max-n"]),
        ({"prompt": ["a"] * 1025}, "prompt", ["1025", "1024", "--max-prompts-per-request"]),
        ({"stop": [f"s{i}" for i in range(65)]}, "stop", ["65", "64", "--max-stop-strings"]),
        ({"stop": "x" * 1025}, "stop", ["1025", "1024", "--max-stop-string-length"]),
    ],
)
def test_default_limits_are_400_naming_the_limit(server, fields, param, named):
    body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 1, **fields}
    start = time.monotonic()
    error = _error(httpx.post(server.base_url + "/v1/completions", json=body, timeout=30))
    assert time.monotonic() - start < 5  # refused up front, not after running anything
    assert error["param"] == param
    assert all(word in error["message"] for word in named), error["message"]
    if param != "prompt":  # chat has the same limits
        chat = {k: v for k, v in body.items() if k != "prompt"}
        chat["messages"] = [{"role": "user", "content": "hi"}]
        error = _error(httpx.post(server.base_url + "/v1/chat/completions", json=chat))
        assert error["param"] == param
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_limits_at_the_edge_are_served(server):
    body = {
        "model": MODEL_NAME,
        "prompt": ["a", "b"],
        "n": 128,
        "max_tokens": 1,
        "stop": [f"s{i}" for i in range(63)] + ["x" * 1024],
    }
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(256))
    server.wait_idle()


@pytest.fixture(scope="module")
def strict_server(bamba_checkpoint):
    options = ServerOptions(
        max_n=2, max_prompts_per_request=3, max_stop_strings=1, max_stop_string_length=4
    )
    with ServerThread(
        build_app(AsyncLLMEngine(make_engine(bamba_checkpoint)), MODEL_NAME, options=options)
    ) as srv:
        yield srv


def test_limits_are_configurable(strict_server):
    url = strict_server.base_url + "/v1/completions"
    ok = {"model": MODEL_NAME, "prompt": ["a", "b", "c"], "n": 2, "stop": "abcd", "max_tokens": 1}
    assert httpx.post(url, json=ok).status_code == 200
    for fields, flag in [
        ({"n": 3}, "--max-n"),
        ({"prompt": ["a"] * 4}, "--max-prompts-per-request"),
        ({"stop": ["a", "b"]}, "--max-stop-strings"),
        ({"stop": "abcde"}, "--max-stop-string-length"),
    ]:
        assert flag in _error(httpx.post(url, json={**ok, **fields}))["message"]


POISON = 7  # a token id whose decoding fails, standing in for any per-request bug


@pytest.fixture(scope="module")
def poisoned_server(bamba_checkpoint):
    """A server whose tokenizer cannot decode anything that holds token POISON."""
    engine = make_engine(bamba_checkpoint)
    tokenizer = engine.tokenizer
    real_decode = tokenizer.decode

    def decode(ids, *args, **kwargs):
        if POISON in (ids if isinstance(ids, list) else [ids]):
            raise KeyError(f"cannot decode token {POISON}")
        return real_decode(ids, *args, **kwargs)

    tokenizer.decode = decode
    with ServerThread(build_app(AsyncLLMEngine(engine), MODEL_NAME)) as srv:
        yield srv


def test_a_request_that_fails_in_the_engine_fails_alone(poisoned_server):
    srv = poisoned_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    common = dict(
        model=MODEL_NAME,
        prompt=[1, 2, 3],
        max_tokens=60,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = client.completions.create(**common).choices[0].text
    texts: list[str] = []

    def run_stream() -> None:
        stream = client.completions.create(stream=True, **common)
        texts.append("".join(c.choices[0].text for c in stream if c.choices))

    thread = threading.Thread(target=run_stream)
    thread.start()
    # The prompt ends in POISON: the detokenizer fails on its first generated token.
    bad = {"model": MODEL_NAME, "prompt": [1, 2, POISON], "max_tokens": 20, "ignore_eos": True}
    for _ in range(3):
        error = _error(httpx.post(srv.base_url + "/v1/completions", json=bad), 500)
        assert "cannot decode token" in error["message"] and error["type"] == "server_error"
        with httpx.stream(
            "POST", srv.base_url + "/v1/completions", json={**bad, "stream": True}
        ) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert (
            "cannot decode token"
            in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
        )
        assert httpx.get(srv.base_url + "/health").status_code == 200
    thread.join(60)
    assert texts == [expected]  # the healthy stream ran through, unchanged
    metrics = srv.wait_idle()
    assert metrics["ssmserve:kv_blocks_used"] == 0 and metrics["ssmserve:state_slots_used"] == 0
    assert client.completions.create(**common).choices[0].text == expected
