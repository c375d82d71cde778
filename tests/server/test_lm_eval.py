"""#18.13: what scoring clients need. The server driven the way lm-eval-harness's
`local-completions` model drives it (remote tokenizer, token-id prompts, echo + logprobs)
gives transformers' teacher-forced loglikelihoods; stop strings completed by the last
allowed token still stop; max_tokens=0 with echo scores a prompt; legacy top_logprobs hold
the chosen token."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from ssmserve.llm import LLM
from ssmserve.sampling_params import SamplingParams
from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.options import ServerOptions
from tests.server.conftest import MODEL_NAME, ServerThread, engine_kwargs, make_engine

CHAT = [{"role": "user", "content": "def hello(name):"}]
# (context, continuation) pairs as lm-eval's tasks make them: a prompt and a candidate.
SNIPPETS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "import heapq\nheap = []\nheapq.heappush(heap, 3)\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n",
    "for i in range(10):\n    print(i * i)\n",
    "def shorten(text, width):\n    return text[:width]\n",
    "x = [1, 2, 3]\ny = sorted(x, reverse=True)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "# compute the mean\ntotal = sum(values) / len(values)\n",
]
PAIRS = [
    (snippet[:cut], snippet[cut:])
    for snippet in SNIPPETS
    for cut in (0, 5, len(snippet) // 3, len(snippet) // 2, len(snippet) - 6)
]


# ----------------------------------------------------------------------------- stop strings


def _stop_at_last_token(texts: list[str]) -> tuple[int, str]:
    """(k, stop) from the texts after each generated token: a stop string that token k
    completes (it is that token's own text) and that occurs nowhere before."""
    for k in range(len(texts), 1, -1):
        before, text = texts[k - 2], texts[k - 1]
        new = text[len(before) :]
        if new.strip() and "\ufffd" not in new and text.find(new) == len(before):
            return k, new
    raise AssertionError(f"no token adds a fresh stop string: {texts}")


def _texts(run, max_tokens: int) -> list[str]:
    """The text after each of the first `max_tokens` greedy tokens, as the engine gives it."""
    return [
        run(SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))[0].outputs[0].text
        for k in range(1, max_tokens + 1)
    ]


@pytest.fixture(scope="module")
def offline(bamba_checkpoint) -> LLM:
    return LLM(bamba_checkpoint, **engine_kwargs())


def test_stop_string_completed_by_the_last_allowed_token_offline(offline):
    texts = _texts(lambda p: offline.generate("def fib(n):", p), 16)
    k, stop = _stop_at_last_token(texts)
    for include in (False, True):
        params = SamplingParams(
            max_tokens=k,
            temperature=0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        out = offline.generate("def fib(n):", params)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == (texts[k - 1] if include else texts[k - 2])
        assert len(out.token_ids) == k


def test_stop_string_completed_by_the_last_allowed_token_served(server, offline):
    url = server.base_url
    for path, prompt_fields, run in [
        (
            "/v1/completions",
            {"prompt": "def fib(n):"},
            lambda p: offline.generate("def fib(n):", p),
        ),
        ("/v1/chat/completions", {"messages": CHAT}, lambda p: offline.chat(CHAT, p)),
    ]:
        texts = _texts(run, 16)
        k, stop = _stop_at_last_token(texts)
        body = {
            "model": MODEL_NAME,
            "max_tokens": k,
            "temperature": 0,
            "ignore_eos": True,
            "stop": [stop],
            **prompt_fields,
        }
        choice = httpx.post(url + path, json=body).json()["choices"][0]
        text = choice["message"]["content"] if "messages" in body else choice["text"]
        assert (choice["finish_reason"], choice["stop_reason"], text) == (
            "stop",
            stop,
            texts[k - 2],
        )
        with httpx.stream("POST", url + path, json={**body, "stream": True}) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        pieces = [e["choices"][0] for e in events]
        streamed = "".join(
            (p["delta"].get("content") or "") if "delta" in p else p["text"] for p in pieces
        )
        assert streamed == texts[k - 2] and pieces[-1]["finish_reason"] == "stop"


# ----------------------------------------------------------------------------- lm-eval


@pytest.fixture(scope="module")
def scoring_server(bamba_checkpoint):
    options = ServerOptions(enable_tokenizer_info_endpoint=True)
    engine = make_engine(bamba_checkpoint)
    with ServerThread(build_app(AsyncLLMEngine(engine), MODEL_NAME, options=options)) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(bamba_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(bamba_checkpoint, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        """transformers' log-softmax at each position, teacher-forced on `ids`: [len-1, V]."""
        logits = model(torch.tensor([ids])).logits[0].double()
        return logits[:-1].log_softmax(-1)

    return logprobs


def test_tokenizer_info_is_behind_its_flag(server, scoring_server, engine):
    assert httpx.get(server.base_url + "/tokenizer_info").status_code == 404
    info = httpx.get(scoring_server.base_url + "/tokenizer_info").json()
    tokenizer = engine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == engine.model_config.max_model_len
    assert info["vocab_size"] == len(tokenizer)


class RemoteTokenizer:
    """What lm-eval's remote tokenizer backend does with the server's endpoints."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        info = httpx.get(base_url + "/tokenizer_info").json()
        assert "eos_token" in info  # lm-eval's check for remote tokenizer support
        self.info = info

    def encode(self, text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        return httpx.post(self.base_url + "/tokenize", json=body).json()["tokens"]

    def prefix_token_id(self) -> int:
        return self.encode(self.info["bos_token"] or self.info["eos_token"])[0]


def _encode_pair(
    tok: RemoteTokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM: trailing spaces move to the continuation; an empty context is
    the prefix token; the continuation is what the whole adds to the context."""
    if not context:
        return [tok.prefix_token_id()], tok.encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx) :]


@pytest.mark.parametrize("max_tokens", [1, 0])  # lm-eval sends 1; vLLM's scorers send 0
def test_lm_eval_loglikelihoods_match_transformers(scoring_server, reference, max_tokens):
    tok = RemoteTokenizer(scoring_server.base_url)
    requests = [_encode_pair(tok, c, x) for c, x in PAIRS]
    results = []
    batch = 8
    for start in range(0, len(requests), batch):
        chunk = requests[start : start + batch]
        payload = {
            "model": MODEL_NAME,
            "prompt": [ctx + cont for ctx, cont in chunk],
            "temperature": 0,
            "max_tokens": max_tokens,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        response = httpx.post(
            scoring_server.base_url + "/v1/completions", json=payload, timeout=120
        )
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        for (ctx, cont), choice in zip(chunk, choices, strict=True):
            lp = choice["logprobs"]
            end = -1 if max_tokens else None  # lm-eval drops the generated token
            assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + max_tokens
            tokens_lp = lp["token_logprobs"][len(ctx) : end]
            tops = lp["top_logprobs"][len(ctx) : end]
            greedy = all(t == max(top.values()) for t, top in zip(tokens_lp, tops, strict=True))
            results.append((sum(tokens_lp), greedy, tokens_lp))
    assert len(results) == len(PAIRS) == 40
    worst = 0.0  # error relative to the logprob's size (float32 rounds relative to it)
    for (ctx, cont), (loglik, greedy, tokens_lp) in zip(requests, results, strict=True):
        lps = reference(ctx + cont)
        positions = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
        want = [float(lps[p, t]) for p, t in zip(positions, cont, strict=True)]
        want_greedy = all(int(lps[p].argmax()) == t for p, t in zip(positions, cont, strict=True))
        for got, ref in zip(tokens_lp, want, strict=True):
            worst = max(worst, abs(got - ref) / max(1.0, abs(ref)))
        assert abs(loglik - sum(want)) <= 5e-6 * sum(max(1.0, abs(w)) for w in want)
        assert greedy == want_greedy
    assert worst < 5e-6, worst


def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(
    scoring_server, engine, reference
):
    prompt = "def fib(n):\n    return n"
    ids = engine.tokenizer(prompt).input_ids
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    r = httpx.post(scoring_server.base_url + "/v1/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None
    want = reference(ids)
    for i, (got, token) in enumerate(zip(lp["token_logprobs"][1:], ids[1:], strict=True)):
        assert math.isclose(got, float(want[i, token]), abs_tol=1e-5)
    # Streamed: the same, in one chunk, then [DONE].
    with httpx.stream(
        "POST", scoring_server.base_url + "/v1/completions", json={**body, "stream": True}
    ) as s:
        events = [x for x in s.iter_lines() if x]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == prompt
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == lp["tokens"]
    # Without echo, max_tokens must still be at least 1.
    r = httpx.post(scoring_server.base_url + "/v1/completions", json={**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_legacy_top_logprobs_hold_the_chosen_token(scoring_server, engine, reference):
    prompt = "while True:\n    line = input()"
    ids = engine.tokenizer(prompt).input_ids
    lps = reference(ids)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    lp = httpx.post(scoring_server.base_url + "/v1/completions", json=body).json()["choices"][0][
        "logprobs"
    ]
    surprising = 0
    for i, token in enumerate(ids[1:]):
        top = lp["top_logprobs"][i + 1]
        best = int(lps[i].argmax())
        chosen_text = engine.tokenizer.decode([token])
        assert chosen_text in top and math.isclose(top[chosen_text], lp["token_logprobs"][i + 1])
        assert engine.tokenizer.decode([best]) in top
        if best != token:
            surprising += 1
            assert len(top) == 2  # logprobs + 1 entries: the top one and the chosen one
        else:
            assert len(top) == 1
    assert surprising > 0  # the prompt holds tokens the model did not rank first
