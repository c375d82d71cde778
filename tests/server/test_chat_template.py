"""#18.3: chat templates sent in requests are refused unless the server trusts them; trusted,
they render in transformers' sandbox against a time limit."""

from __future__ import annotations

import time

import httpx
import pytest

from ssmserve.llm import LLM
from ssmserve.sampling_params import SamplingParams
from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.options import ServerOptions
from tests.server.conftest import MODEL_NAME, ServerThread, engine_kwargs, make_engine

MESSAGES = [{"role": "user", "content": "def hello(name):"}]
TEMPLATE = "{% for m in messages %}## {{ m['content'] }}\n{% endfor %}>>> "
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TIME_LIMIT = 0.5


def _chat(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json={**body, **fields}, timeout=60)


@pytest.mark.parametrize(
    "fields",
    [{"chat_template": TEMPLATE}, {"chat_template_kwargs": {"chat_template": TEMPLATE}}],
)
def test_request_templates_are_refused_by_default(server, fields):
    r = _chat(server.base_url, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]


def test_template_variables_that_steer_apply_chat_template_are_refused(server):
    r = _chat(server.base_url, chat_template_kwargs={"tokenize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    # Plain template variables are fine.
    assert _chat(server.base_url, chat_template_kwargs={"anything": 1}).status_code == 200


@pytest.fixture(scope="module")
def trusting_server(bamba_checkpoint):
    options = ServerOptions(trust_request_chat_template=True, chat_template_timeout=TIME_LIMIT)
    engine = make_engine(bamba_checkpoint)
    with ServerThread(build_app(AsyncLLMEngine(engine), MODEL_NAME, options=options)) as srv:
        yield srv


def test_trusted_request_template_renders_like_the_offline_api(trusting_server, bamba_checkpoint):
    params = SamplingParams(max_tokens=6, temperature=0)
    want = LLM(bamba_checkpoint, **engine_kwargs()).chat(MESSAGES, params, chat_template=TEMPLATE)
    for fields in (
        {"chat_template": TEMPLATE},
        {"chat_template_kwargs": {"chat_template": TEMPLATE}},
    ):
        r = _chat(trusting_server.base_url, **fields)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == want[0].outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(want[0].prompt_token_ids)


def test_a_template_that_runs_too_long_is_stopped(trusting_server):
    url = trusting_server.base_url
    start = time.monotonic()
    r = _chat(url, chat_template=NESTED_LOOP)
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and "--chat-template-timeout" in error["message"]
    # 10^10 loop iterations would take hours; it stopped at the limit.
    assert TIME_LIMIT <= took < TIME_LIMIT + 5
    # The thread it ran on is free again: the next request renders at once.
    start = time.monotonic()
    assert _chat(url, chat_template=TEMPLATE).status_code == 200
    assert time.monotonic() - start < 5


def test_the_sandbox_refuses_reaching_out_of_the_template(trusting_server):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    r = _chat(trusting_server.base_url, chat_template=escape)
    assert r.status_code == 400, r.text
    assert "unsafe" in r.json()["error"]["message"]
