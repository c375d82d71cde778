"""Server-Sent Events shared by the streaming endpoints.

`StreamState` remembers what each choice of one response has sent (characters, tokens,
whether it finished), so each engine output becomes one delta per choice that advanced.
`sse_events` drives it over the request streams; `event_stream_response` wraps the events
in an SSE response that ends with `data: [DONE]` however the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from ssmserve.outputs import CompletionOutput, RequestOutput
from ssmserve.server.async_engine import RequestStream
from ssmserve.server.errors import error_info
from ssmserve.server.protocol import ErrorResponse, UsageInfo
from ssmserve.server.serving import Timing, abort_all, merged_outputs, usage

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"


def sse(chunk: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(exc: BaseException) -> str:
    return f"data: {ErrorResponse(error=error_info(exc)).model_dump_json()}\n\n"


@dataclass
class ChoiceUpdate:
    """What one choice gained from one engine output."""

    choice: int  # the choice's index in the response
    output: RequestOutput
    completion: CompletionOutput
    start_char: int  # text before this is already sent
    start_token: int  # tokens before this are already sent
    first: bool  # nothing of this choice was sent before

    @property
    def new_text(self) -> str:
        return self.completion.text[self.start_char :]

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason


class StreamState:
    """Per-choice bookkeeping of one streamed response over `num_prompts` engine requests of
    `n` samples each; choice index = prompt index * n + sample index."""

    def __init__(self, num_prompts: int, n: int) -> None:
        self.n = n
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.prompt_tokens = [0] * num_prompts

    def updates(
        self, stream_index: int, output: RequestOutput, *, send_first: bool = False
    ) -> Iterator[ChoiceUpdate]:
        """The choices of `output` with new text or a finish; with `send_first`, also each
        choice that has sent nothing yet (an echoed prompt goes out before any token).

        A token that adds no text yet (part of a character, or text held back while it may
        start a stop string) waits for the next update, which carries its logprobs too:
        no chunk goes out empty, as OpenAI sends none."""
        self.prompt_tokens[stream_index] = len(output.prompt_token_ids)
        for out in output.outputs:
            choice = stream_index * self.n + out.index
            if choice in self.done:
                continue
            first = choice not in self.sent_chars
            start_char = self.sent_chars.get(choice, 0)
            start_token = self.sent_tokens.get(choice, 0)
            advanced = len(out.text) > start_char or out.finish_reason is not None
            if not advanced and not (first and send_first):
                continue
            self.sent_chars[choice] = len(out.text)
            self.sent_tokens[choice] = len(out.token_ids)
            if out.finish_reason is not None:
                self.done.add(choice)
            yield ChoiceUpdate(choice, output, out, start_char, start_token, first)

    def usage(self) -> UsageInfo:
        return usage(sum(self.prompt_tokens), sum(self.sent_tokens.values()))


async def sse_events(
    streams: list[RequestStream],
    timing: Timing,
    state: StreamState,
    chunk_of: Callable[[ChoiceUpdate], str],
    *,
    opening: Iterable[str] = (),
    usage_chunk: Callable[[UsageInfo], str] | None = None,
    send_first: Callable[[RequestOutput], bool] | None = None,
) -> AsyncIterator[str]:
    """The events of one streamed response: `opening`, one `chunk_of` per choice update,
    then the usage chunk if asked for."""
    for event in opening:
        yield event
    async for index, output in merged_outputs(streams, timing):
        ready = send_first is not None and send_first(output)
        for update in state.updates(index, output, send_first=ready):
            yield chunk_of(update)
    if usage_chunk is not None:
        yield usage_chunk(state.usage())


class _EventStreamResponse(StreamingResponse):
    """SSE response that runs `on_close` however it ends, even if never iterated."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # NOTE: a client that disconnects before the first chunk cancels the body
            # iterator before it starts, so its own `finally` never runs; this one does.
            self._on_close()


def event_stream_response(
    request_id: str, events: AsyncIterator[str], streams: list[RequestStream]
) -> StreamingResponse:
    """SSE of `events`; a failure becomes an error event; always ends with [DONE]; closing
    it aborts whatever of `streams` still runs."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as exc:  # noqa: BLE001 - reported in the stream
            logger.warning("stream %s failed: %s", request_id, exc)
            yield sse_error(exc)
        yield DONE_EVENT

    return _EventStreamResponse(body(), on_close=lambda: abort_all(streams))
