"""#18.7 and #18.11: what the server says about itself is true, and streams and bodies have
the shapes OpenAI sends."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME

CHAT = [{"role": "user", "content": "def hello(name):"}]


def test_openapi_documents_400_not_422(server):
    schema = httpx.get(server.base_url + "/openapi.json").json()
    posts = [path for path, ops in schema["paths"].items() if "post" in ops]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= set(posts)
    for path in posts:
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses, path
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorResponse"
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert error["properties"]["error"]["$ref"] == "#/components/schemas/ErrorInfo"
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    # And a validation error is indeed a 400 of that shape.
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "n": "many"})
    assert r.status_code == 400 and set(r.json()["error"]) == set(
        schema["components"]["schemas"]["ErrorInfo"]["properties"]
    )


def test_health_is_json(server):
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}


def test_405_names_the_allowed_methods(server):
    r = httpx.get(server.base_url + "/v1/completions")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(guarded_server, scheme):
    headers = {"Authorization": f"{scheme} {API_KEY}"}
    assert httpx.get(guarded_server.base_url + "/v1/models", headers=headers).status_code == 200
    wrong = {"Authorization": f"{scheme} {API_KEY.upper()}"}  # the key itself is exact
    assert httpx.get(guarded_server.base_url + "/v1/models", headers=wrong).status_code == 401
    basic = {"Authorization": f"Basic {API_KEY}"}
    assert httpx.get(guarded_server.base_url + "/v1/models", headers=basic).status_code == 401


@pytest.mark.parametrize("role", ["hacker", "", "USER", None])
def test_unknown_chat_roles_are_refused(server, role):
    body = {"model": MODEL_NAME, "messages": [{"role": role, "content": "hi"}]}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "user" in error["message"]


def test_malformed_json_says_what_is_wrong(server):
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] is None
    assert error["message"].startswith("the request body is not valid JSON: ")
    assert "at character 25" in error["message"]


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("stop", [None, ["zzz"]])  # a stop string holds text back
def test_chat_stream_deltas_as_openai_sends_them(server, stop):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 20, "ignore_eos": True}
    chunks = _events(server.base_url + "/v1/chat/completions", {**body, "stop": stop})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    # Later deltas carry content only: no "role": null, no empty content.
    for delta in deltas[1:-1]:
        assert set(delta) == {"content"} and delta["content"], delta
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert set(deltas[-1]) <= {"content"}


@pytest.mark.parametrize("stop", [None, ["zzz"]])
def test_completion_stream_has_no_empty_chunks(server, stop):
    body = {
        "model": MODEL_NAME,
        "prompt": "def fib(n):",
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    chunks = _events(server.base_url + "/v1/completions", {**body, "stop": stop})
    choices = [c["choices"][0] for c in chunks]
    assert all(c["text"] for c in choices[:-1]), [c["text"] for c in choices]
    assert choices[-1]["finish_reason"] == "length"
    full = httpx.post(server.base_url + "/v1/completions", json={**body, "stop": stop}).json()
    assert "".join(c["text"] for c in choices) == full["choices"][0]["text"]


def test_stream_logprobs_stay_aligned_when_tokens_wait_for_text(server):
    body = {
        "model": MODEL_NAME,
        "prompt": "def fib(n):",
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "stop": ["zzzz"],  # holds three characters back at every step
    }
    chunks = _events(server.base_url + "/v1/completions", body)
    full = httpx.post(server.base_url + "/v1/completions", json=body).json()["choices"][0]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    logprobs = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == full["logprobs"]["tokens"] and len(tokens) == 24
    assert logprobs == full["logprobs"]["token_logprobs"]


def test_tokenize_returns_token_strings(server, engine):
    text = "def fib(n):\n    return n"
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    body = r.json()
    assert body["token_strs"] == engine.tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = httpx.post(server.base_url + "/tokenize", json={"prompt": text}).json()
    assert plain["token_strs"] is None and plain["tokens"] == body["tokens"]


def test_usage_has_prompt_tokens_details(server):
    body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 2}
    usage = httpx.post(server.base_url + "/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2}
    chunks = _events(
        server.base_url + "/v1/chat/completions",
        {**chat, "stream_options": {"include_usage": True}},
    )
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
