"""32 concurrent streaming clients all finish, with the offline engine's greedy outputs."""

from __future__ import annotations

import asyncio

import openai

from ssmserve.llm import LLM
from ssmserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME, engine_kwargs

NUM_CLIENTS = 32
SEEDS = [
    "def fib(n):",
    "import heapq",
    "class Node:",
    "    return",
    "for i in range(",
    "x = [",
    "# compute the",
    "while True:",
]


def _requests():
    """(kind, prompt text or messages, max_tokens) per client: half completions, half chat."""
    out = []
    for i in range(NUM_CLIENTS):
        text = SEEDS[i % len(SEEDS)] + " " * (i // len(SEEDS))
        max_tokens = 8 + (i * 5) % 17
        if i % 2:
            out.append(("chat", [{"role": "user", "content": text}], max_tokens))
        else:
            out.append(("completion", text, max_tokens))
    return out


def _offline(checkpoint, requests):
    """The same requests through the offline API (`LLM.generate` / `LLM.chat`)."""
    llm = LLM(checkpoint, **engine_kwargs())
    results = {}
    for kind in ("completion", "chat"):
        mine = [(i, r) for i, r in enumerate(requests) if r[0] == kind]
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for _, (_, _, max_tokens) in mine
        ]
        run = llm.chat if kind == "chat" else llm.generate
        outputs = run([prompt for _, (_, prompt, _) in mine], params)
        for (i, _), output in zip(mine, outputs, strict=True):
            results[i] = (output.outputs[0].text, len(output.prompt_token_ids))
    return [results[i] for i in range(len(requests))]


def test_32_concurrent_streams_match_offline(server, bamba_checkpoint):
    requests = _requests()
    expected = _offline(bamba_checkpoint, requests)
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

    async def one(kind, prompt, max_tokens):
        common = dict(
            model=MODEL_NAME,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        pieces, usage, finish = [], None, None
        if kind == "chat":
            stream = await client.chat.completions.create(messages=prompt, **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            for c in chunk.choices:
                pieces.append((c.delta.content if kind == "chat" else c.text) or "")
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return "".join(pieces), finish, usage

    async def main():
        return await asyncio.gather(
            *(one(kind, prompt, max_tokens) for kind, prompt, max_tokens in requests)
        )

    results = asyncio.run(main())
    for (_, _, max_tokens), (want, n_prompt), (text, finish, usage) in zip(
        requests, expected, results, strict=True
    ):
        assert finish == "length"
        assert usage.completion_tokens == max_tokens and usage.prompt_tokens == n_prompt
        assert text == want
    m = server.wait_idle()
    assert m["ssmserve:kv_blocks_used"] == 0 and m["ssmserve:state_slots_used"] == 0
