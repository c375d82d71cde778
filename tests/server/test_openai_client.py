"""The official `openai` client against a real server: what a user of the API sees."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

CHAT = [{"role": "user", "content": "def hello(name):"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_health_and_tokenize(server, client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200

    text = "def fib(n):\n    return n"
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": text})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == engine.tokenizer(text).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == text

    r = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT})
    tok = engine.tokenizer
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = tok(rendered, add_special_tokens=False).input_ids
    assert r.status_code == 200 and r.json()["tokens"] == expected


def test_completion_text_and_token_prompts_agree(client, engine):
    prompt = "def hello(name):"
    ids = engine.tokenizer(prompt).input_ids
    by_text = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_text.object == "text_completion" and by_text.model == MODEL_NAME
    (choice,) = by_text.choices
    assert choice.finish_reason == "length" and choice.text
    assert by_ids.choices[0].text == choice.text
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.usage.completion_tokens == 8
    assert by_text.usage.total_tokens == len(ids) + 8


def test_completion_several_prompts_and_echo(client):
    prompts = ["import heapq", "def fib(n):"]
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=4,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    for prompt, choice in zip(prompts, r.choices, strict=True):
        alone = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert choice.text == prompt + alone.choices[0].text
    assert r.usage.completion_tokens == 8


def test_completion_stop_string(client):
    free = (
        client.completions.create(
            model=MODEL_NAME,
            prompt="def hello",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = free[3:5]
    assert stop.strip(), f"pick a visible stop string from {free!r}"
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="def hello",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
    assert free.startswith(r.choices[0].text)


def test_completion_logprobs(client):
    k = 3
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="def hello",
        max_tokens=6,
        temperature=0,
        logprobs=k,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    if "\ufffd" not in choice.text:  # byte tokens of a split character decode to U+FFFD
        assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # Keys are token texts, so two byte tokens that both decode to U+FFFD share one.
        assert token_logprob <= 0 and 1 <= len(top) <= k
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(token_logprob, max(top.values()), abs_tol=1e-5)


def test_completion_echo_logprobs_cover_the_prompt(client, engine):
    prompt = "def fib(n):"
    n_prompt = len(engine.tokenizer(prompt).input_ids)
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert r.choices[0].text.startswith(prompt)


def test_stream_echo_sends_the_prompt_once(client):
    common = dict(
        model=MODEL_NAME,
        prompt="def fib(n):",
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**common).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **common)]
    assert "".join(c.text for c in chunks) == full.text
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    # Without logprobs too.
    del common["logprobs"]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **common)]
    assert "".join(c.text for c in chunks) == full.text


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 6
    # max_tokens (deprecated by OpenAI, still sent by many clients) means the same.
    r2 = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r2.choices[0].message.content == choice.message.content


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    if "\ufffd" not in r.choices[0].message.content:
        assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode())
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token  # greedy
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-5)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_with_seed_is_reproducible(client, endpoint):
    def sample(seed):
        kwargs = dict(
            model=MODEL_NAME,
            max_tokens=10,
            temperature=1.0,
            n=3,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        if endpoint == "chat":
            r = client.chat.completions.create(messages=CHAT, **kwargs)
            return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
        r = client.completions.create(prompt="def hello", **kwargs)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert len(first) == 3
    assert sample(1234) == first
    assert len(set(first)) > 1, "n samples at temperature 1 should differ"
    assert sample(99) != first


def _stream_texts(chunks, chat: bool):
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if chat else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_equals_non_stream_with_usage_last(client, endpoint):
    common = dict(model=MODEL_NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    if endpoint == "chat":
        full = client.chat.completions.create(messages=CHAT, **common)
        chunks = list(
            client.chat.completions.create(
                messages=CHAT, stream=True, stream_options={"include_usage": True}, **common
            )
        )
        expected = full.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        full = client.completions.create(prompt="def hello", **common)
        chunks = list(
            client.completions.create(
                prompt="def hello", stream=True, stream_options={"include_usage": True}, **common
            )
        )
        expected = full.choices[0].text
    texts, finish = _stream_texts(chunks[:-1], chat=endpoint == "chat")
    assert texts == {0: expected} and finish == {0: "length"}
    # Streamed piece by piece (tokens that add no text yet wait for the next piece).
    assert sum(1 for c in chunks if c.choices) > 2
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_chunks_arrive_while_generating(server, client):
    """The first chunk reaches the client long before the request finishes."""
    max_tokens = 200
    before = server.metrics()["ssmserve:generation_tokens_total"]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="def hello",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    generated_so_far = server.metrics()["ssmserve:generation_tokens_total"] - before
    assert first.choices[0].text is not None
    assert generated_so_far < max_tokens / 2
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert server.metrics()["ssmserve:generation_tokens_total"] - before >= max_tokens


def test_stream_n_and_several_prompts(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=["def a", "def b"],
            n=2,
            max_tokens=5,
            temperature=0.8,
            seed=7,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    texts, finish = _stream_texts(chunks, chat=False)
    assert sorted(texts) == [0, 1, 2, 3] and set(finish.values()) == {"length"}
    full = client.completions.create(
        model=MODEL_NAME,
        prompt=["def a", "def b"],
        n=2,
        max_tokens=5,
        temperature=0.8,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert {c.index: c.text for c in full.choices} == texts


def test_metrics(server, client):
    names = [
        "num_requests_running",
        "num_requests_waiting",
        "kv_blocks_used",
        "kv_blocks_total",
        "state_slots_used",
        "state_slots_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
    ]
    before = server.metrics()
    assert all(f"ssmserve:{name}" in before for name in names), sorted(before)
    r = client.completions.create(
        model=MODEL_NAME,
        prompt="def hello",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = server.wait_idle()

    def grew(name):
        return after[f"ssmserve:{name}"] - before[f"ssmserve:{name}"]

    assert grew("prompt_tokens_total") == r.usage.prompt_tokens
    assert grew("generation_tokens_total") == 5
    assert grew("time_to_first_token_seconds_count") == 1
    assert grew("inter_token_latency_seconds_count") == 4
    assert after["ssmserve:kv_blocks_total"] > 0 and after["ssmserve:state_slots_total"] > 0


def test_chat_content_parts_equal_plain_text(client):
    common = dict(model=MODEL_NAME, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(messages=CHAT, **common)
    parts = [{"type": "text", "text": "def hello"}, {"type": "text", "text": "(name):"}]
    split = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **common)
    assert split.choices[0].message.content == plain.choices[0].message.content
