"""Every error a client can cause gets OpenAI's error shape and the right status, and harms no
other request."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from tests.server.conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME, ServerThread, make_engine


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error["message"]


BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"min_tokens": 9, "max_tokens": 4}, None),
]


@pytest.mark.parametrize(("fields", "param"), BAD_PARAMS)
def test_completion_invalid_params_are_400(server, fields, param):
    body = {"model": MODEL_NAME, "prompt": "def hello", **fields}
    r = httpx.post(server.base_url + "/v1/completions", json=body)
    _assert_error(r, 400, param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ],
)
def test_chat_invalid_params_are_400(server, fields, param):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    _assert_error(r, 400, param)


def test_malformed_json_is_400(server):
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=b'{"model": "x", "prompt": ',
        headers={"content-type": "application/json"},
    )
    _assert_error(r, 400)


def test_prompt_longer_than_max_model_len_says_both_numbers(server, engine):
    prompt = "def hello(name): return name\n" * 200
    n_tokens = len(engine.tokenizer(prompt).input_ids)
    assert n_tokens > MAX_MODEL_LEN
    for path, body in [
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/completions", {"prompt": engine.tokenizer(prompt).input_ids}),
        ("/v1/completions", {"prompt": prompt, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
    ]:
        r = httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body})
        message = _assert_error(r, 400)
        assert str(MAX_MODEL_LEN) in message, message
        if path == "/v1/completions":
            assert str(n_tokens) in message, message


def test_prompt_plus_max_tokens_over_the_context_is_400(server, engine):
    ids = engine.tokenizer("x = 1\n" * 400).input_ids[: MAX_MODEL_LEN - 10]
    assert len(ids) == MAX_MODEL_LEN - 10
    for path, body in [
        ("/v1/completions", {"prompt": ids, "max_tokens": 50}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x = 1\n" * 60}],
                "max_completion_tokens": MAX_MODEL_LEN,
            },
        ),
    ]:
        r = httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body})
        message = _assert_error(r, 400, "max_tokens")
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message, message
    # Within the context, the same prompt runs.
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 5},
    )
    assert r.status_code == 200, r.text


def test_unknown_model_is_404(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert "gpt-17" in info.value.body["message"]
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
    )
    _assert_error(r, 404, "model")


def test_unknown_route_is_404_in_openai_shape(server):
    _assert_error(httpx.get(server.base_url + "/v1/nothing-here"), 404)


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )


def test_api_key(guarded_server):
    url = guarded_server.base_url
    body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 2}
    _assert_error(httpx.post(url + "/v1/completions", json=body), 401)
    _assert_error(
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"}),
        401,
    )
    _assert_error(httpx.get(url + "/v1/models"), 401)
    _assert_error(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401)
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(url + "/v1/completions", json=body, headers=good).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    assert httpx.get(url + "/metrics").status_code == 200

    wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert right.models.list().data[0].id == MODEL_NAME


def test_oversized_body_is_413(guarded_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {"model": MODEL_NAME, "prompt": "x" * 70000}
    r = httpx.post(guarded_server.base_url + "/v1/completions", json=big, headers=headers)
    _assert_error(r, 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 8192):
            yield payload[i : i + 8192]

    r = httpx.post(
        guarded_server.base_url + "/v1/completions",
        content=chunked(),
        headers={**headers, "content-type": "application/json"},
    )
    _assert_error(r, 413)
    small = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 2}
    r = httpx.post(guarded_server.base_url + "/v1/completions", json=small, headers=headers)
    assert r.status_code == 200


def test_chat_without_template_is_400(guarded_server):
    r = httpx.post(
        guarded_server.base_url + "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    message = _assert_error(r, 400)
    assert "chat template" in message


def test_bad_requests_do_not_disturb_a_running_stream(server):
    """A long stream runs while bad requests of every kind come and go; it is unchanged."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    common = dict(
        model=MODEL_NAME,
        prompt="def fib(n):",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = client.completions.create(**common).choices[0].text
    texts = []

    def run_stream():
        stream = client.completions.create(stream=True, **common)
        texts.append("".join(c.choices[0].text for c in stream if c.choices))

    thread = threading.Thread(target=run_stream)
    thread.start()
    for fields, _ in BAD_PARAMS:
        body = {"model": MODEL_NAME, "prompt": "def hello", **fields}
        assert httpx.post(server.base_url + "/v1/completions", json=body).status_code == 400
    too_long = {"model": MODEL_NAME, "prompt": "x y " * 2000}
    assert httpx.post(server.base_url + "/v1/completions", json=too_long).status_code == 400
    thread.join(timeout=60)
    assert texts == [expected]


def test_engine_crash_fails_requests_with_500_and_health_503(bamba_checkpoint):
    engine = make_engine(bamba_checkpoint)
    real_step = engine.step

    def step_that_crashes():
        # Crash once all four requests below are in, so each sees it mid-flight.
        stats = engine.stats()
        if stats["num_running"] + stats["num_waiting"] >= 4:
            raise RuntimeError("simulated CUDA error")
        return real_step()

    engine.step = step_that_crashes
    app = build_app(AsyncLLMEngine(engine), MODEL_NAME)
    with ServerThread(app) as srv:
        body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 50, "ignore_eos": True}

        async def crash_under_load():
            async with httpx.AsyncClient(timeout=30) as http:

                async def stream_events():
                    url = srv.base_url + "/v1/completions"
                    async with http.stream("POST", url, json={**body, "stream": True}) as r:
                        assert r.status_code == 200
                        return [line async for line in r.aiter_lines() if line]

                plain = [http.post(srv.base_url + "/v1/completions", json=body) for _ in range(3)]
                return await asyncio.gather(stream_events(), *plain)

        events, *responses = asyncio.run(crash_under_load())
        for r in responses:
            assert _assert_error(r, 500).startswith("the engine crashed")
        # The stream had started: it ends with an error event, then [DONE].
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["message"].startswith(
            "the engine crashed"
        )
        # Later requests are refused at once, and the probe reports the engine dead.
        r = httpx.post(srv.base_url + "/v1/completions", json={**body, "stream": True})
        _assert_error(r, 500)
        _assert_error(httpx.get(srv.base_url + "/health"), 503)


def test_non_text_content_is_400(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": [image]}]},
    )
    assert "image_url" in _assert_error(r, 400, "messages")
