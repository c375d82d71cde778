"""The endpoint handlers and the shared stream bookkeeping on their own, without an HTTP app."""

from __future__ import annotations

import asyncio
import json

from ssmserve.llm import LLM
from ssmserve.outputs import CompletionOutput, RequestOutput
from ssmserve.sampling_params import SamplingParams
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.chat import Chat
from ssmserve.server.completions import Completions
from ssmserve.server.protocol import ChatCompletionRequest, CompletionRequest
from ssmserve.server.serving import ServingContext
from ssmserve.server.streaming import StreamState
from tests.server.conftest import engine_kwargs, make_engine

PROMPT = "def fib(n):"
CHAT = [{"role": "user", "content": "def hello(name):"}]


def _output(texts: list[str], tokens: list[int], finished: list[bool]) -> RequestOutput:
    outs = [
        CompletionOutput(
            index=i, text=t, token_ids=list(range(k)), finish_reason="length" if f else None
        )
        for i, (t, k, f) in enumerate(zip(texts, tokens, finished, strict=True))
    ]
    return RequestOutput("r", None, [1, 2, 3], None, outs, finished=all(finished))


def test_stream_state_sends_each_choice_once_per_advance():
    state = StreamState(num_prompts=2, n=2)
    first = list(state.updates(1, _output(["a", ""], [1, 0], [False, False])))
    assert [(u.choice, u.new_text, u.start_token, u.first) for u in first] == [(2, "a", 0, True)]
    # A token that adds no text yet waits: no update, and the next one starts before it.
    assert list(state.updates(1, _output(["a", ""], [2, 1], [False, False]))) == []
    # With send_first, a choice that has sent nothing goes out even without text.
    (echo,) = state.updates(1, _output(["a", ""], [2, 1], [False, False]), send_first=True)
    assert (echo.choice, echo.first, echo.new_text) == (3, True, "")
    later = list(state.updates(1, _output(["abc", "x"], [3, 2], [True, False])))
    assert [(u.choice, u.new_text, u.start_token, u.first) for u in later] == [
        (2, "bc", 1, False),
        (3, "x", 1, False),
    ]
    assert 2 in state.done
    # A finished choice sends nothing more; a finish goes out even without new text.
    assert [u.choice for u in state.updates(1, _output(["abc", "x"], [3, 3], [True, True]))] == [3]
    totals = state.usage()
    assert (totals.prompt_tokens, totals.completion_tokens) == (3, 6)  # prompt 1 only so far


def test_handlers_run_without_an_app(bamba_checkpoint):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(bamba_checkpoint, **engine_kwargs())
    want_completion = llm.generate(PROMPT, greedy)[0].outputs[0].text
    want_chat = llm.chat(CHAT, greedy)[0].outputs[0].text
    async_engine = AsyncLLMEngine(make_engine(bamba_checkpoint))
    ctx = ServingContext(async_engine, "handler-test")
    common = dict(max_tokens=6, temperature=0, ignore_eos=True)

    async def main():
        async_engine.start()
        try:
            completion = await Completions(ctx).create(
                CompletionRequest(prompt=PROMPT, **common), None
            )
            chat = await Chat(ctx).create(ChatCompletionRequest(messages=CHAT, **common), None)
            stream = await Completions(ctx).create(
                CompletionRequest(prompt=PROMPT, stream=True, **common), None
            )
            events = [event async for event in stream.body_iterator]
        finally:
            await async_engine.shutdown()
        return completion, chat, events

    completion, chat, events = asyncio.run(main())
    assert completion.model == "handler-test"
    assert completion.choices[0].text == want_completion
    assert chat.choices[0].message.content == want_chat
    assert events[-1] == "data: [DONE]\n\n"
    streamed = "".join(
        json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]
    )
    assert streamed == want_completion
