"""#18.5: text that is not Unicode, seeds out of range, degenerate temperatures, infinite
penalties and absurd top_k are refused (or, for tiny temperatures, made greedy), naming the
field, without harming the connection."""

from __future__ import annotations

import math

import httpx
import pytest

from ssmserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME

SURROGATE = '"a\\ud800b"'  # JSON for a lone UTF-16 surrogate between two letters


def _raw_post(http: httpx.Client, path: str, json_text: str) -> httpx.Response:
    return http.post(path, content=json_text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "M", "prompt": S}', "prompt"),
        ("/v1/completions", '{"model": "M", "prompt": ["ok", S]}', "prompt"),
        ("/v1/completions", '{"model": "M", "prompt": "ok", "stop": [S]}', "stop"),
        (
            "/v1/chat/completions",
            '{"model": "M", "messages": [{"role": "user", "content": S}]}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            '{"model": "M", "messages": [{"role": "user", "content": '
            '[{"type": "text", "text": S}]}]}',
            "messages",
        ),
        ("/tokenize", '{"prompt": S}', "prompt"),
    ],
)
def test_lone_surrogates_are_400_and_keep_the_connection(server, path, body, param):
    with httpx.Client(base_url=server.base_url) as http:
        r = _raw_post(http, path, body.replace("S", SURROGATE).replace('"M"', f'"{MODEL_NAME}"'))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "surrogate" in error["message"]
        assert r.headers.get("connection", "keep-alive") != "close"
        # The same connection serves the next request.
        assert http.get("/health").status_code == 200
        assert r.extensions["network_stream"] is http.get("/health").extensions["network_stream"]


def test_a_surrogate_pair_is_text(server, engine):
    with httpx.Client(base_url=server.base_url) as http:
        r = _raw_post(http, "/tokenize", '{"prompt": "\\ud83d\\ude00"}')
        assert r.status_code == 200 and r.json()["tokens"] == engine.tokenizer("😀").input_ids


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_out_of_range_names_seed(server, seed):
    body = {"model": MODEL_NAME, "prompt": "def", "max_tokens": 2, "seed": seed}
    r = httpx.post(server.base_url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "seed" and "2**63" in error["message"]
    edge = {**body, "seed": 2**63 - 1, "n": 2, "temperature": 1.0}  # seed + i stays valid
    assert httpx.post(server.base_url + "/v1/completions", json=edge).status_code == 200


@pytest.mark.parametrize(
    ("field", "json_value"),
    [
        ("temperature", "1e999"),
        ("temperature", "NaN"),
        ("repetition_penalty", "1e999"),
        ("top_k", "1000000000000"),
    ],
)
def test_unbounded_sampling_values_are_400(server, field, json_value):
    text = f'{{"model": "{MODEL_NAME}", "prompt": "def", "max_tokens": 2, "{field}": {json_value}}}'
    with httpx.Client(base_url=server.base_url) as http:
        r = _raw_post(http, "/v1/completions", text)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_tiny_temperature_is_greedy(server):
    def text(temperature: float) -> str:
        body = {
            "model": MODEL_NAME,
            "prompt": "def fib(n):",
            "max_tokens": 8,
            "temperature": temperature,
            "ignore_eos": True,
        }
        r = httpx.post(server.base_url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(0)
    assert greedy
    assert text(1e-6) == greedy and text(9.9e-6) == greedy


def test_sampling_params_validation_offline():
    assert SamplingParams(temperature=1e-7).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    for bad in (
        dict(temperature=math.inf),
        dict(temperature=math.nan),
        dict(repetition_penalty=math.inf),
        dict(top_k=2**31),
        dict(seed=2**64),
        dict(seed=-(2**63) - 1),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
