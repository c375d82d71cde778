"""The OpenAI-compatible HTTP API over an AsyncLLMEngine (FastAPI).

`build_app(async_engine, served_model_name, api_key)` returns an ASGI app; `cli.run_serve`
runs it under uvicorn. Streams are Server-Sent Events, one `data: {json}` per chunk and
`data: [DONE]` at the end. Errors use OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ssmserve.outputs import PositionLogprobs, RequestOutput
from ssmserve.sampling_params import SamplingParams
from ssmserve.server.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestAbortedError,
    RequestStream,
)
from ssmserve.server.metrics import ServerMetrics
from ssmserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Paths that need the bearer token when the server has an API key; /health and /metrics
# stay open for load balancers and scrapers.
_PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")
_SAMPLING_PARAM_NAMES = {
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
}


# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error the client caused or should see, with its HTTP status and OpenAI fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def _error_body(message: str, **fields: Any) -> bytes:
    info = ErrorInfo(message=message, type=fields.pop("type", "invalid_request_error"), **fields)
    return ErrorResponse(error=info).model_dump_json().encode()


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=exc.info).model_dump(), status_code=exc.status_code)


def _server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence per offending field; `param` is the first top-level field."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        by_field.setdefault(loc[0] if loc else "", []).append({**err, "loc": loc})
    parts = []
    for field, errors in by_field.items():
        if len(errors) > 1 and all(len(e["loc"]) > 1 for e in errors):
            # A union: pydantic reports one failure per accepted form.
            forms = ", ".join(dict.fromkeys(e["loc"][1] for e in errors))
            parts.append(f"{field}: does not match any accepted form ({forms})")
        else:
            where = ".".join(errors[0]["loc"])
            parts.append(f"{where}: {errors[0]['msg']}" if where else str(errors[0]["msg"]))
    param = next((f for f in by_field if f), None)
    return "; ".join(parts) or "invalid request body", param


# ----------------------------------------------------------------------------- middleware


class _ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on the protected paths."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = (
                    "incorrect or missing API key; send the header `Authorization: Bearer <key>`"
                )
                body = _error_body(message, code="invalid_api_key")
                await _send_json(send, 401, body)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`, whether or not Content-Length is sent."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(send)
            return
        # Buffer the body (the JSON parser needs it whole anyway) and count as it arrives.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = None  # disconnected before the body was complete
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if chunks is None:
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        message = (
            f"request body is larger than the server's limit of {self.max_bytes} bytes; "
            "send a smaller request or raise --max-request-body-bytes"
        )
        await _send_json(send, 413, _error_body(message, code="request_too_large"))


async def _send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ----------------------------------------------------------------------------- helpers


def _sse(chunk: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def _sse_error(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        info = exc.info
    elif isinstance(exc, EngineDeadError):
        info = ErrorInfo(message=str(exc), type="server_error", code="internal_error")
    else:
        info = ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="server_error")
    return f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"


def _sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if req.logit_bias:
        raise _bad_request("logit_bias is not supported", "logit_bias")
    kwargs: dict[str, Any] = dict(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        first_word = str(exc).split(" ", 1)[0]
        param = first_word if first_word in _SAMPLING_PARAM_NAMES else None
        raise _bad_request(str(exc), param) from exc


def _token_text(token_id: int, entry: Any, tokenizer: Any) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def _top(entry: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    return sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]


def _legacy_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    top_n: int,
    tokenizer: Any,
    offset: int,
    into: CompletionLogprobs,
) -> int:
    """Append the completions-API logprobs of `token_ids` to `into`; return the next offset."""
    for token_id, entry in zip(token_ids, positions, strict=False):
        if entry is None:  # the first prompt token has no logprob
            text = tokenizer.decode([token_id])
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            chosen = entry.get(token_id)
            text = _token_text(token_id, chosen, tokenizer)
            into.token_logprobs.append(chosen.logprob if chosen is not None else None)
            into.top_logprobs.append(
                {_token_text(t, lp, tokenizer): lp.logprob for t, lp in _top(entry, top_n)}
            )
        into.tokens.append(text)
        into.text_offset.append(offset)
        offset += len(text)
    return offset


def _chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int, tokenizer: Any
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, positions, strict=False):
        chosen = entry.get(token_id)
        text = _token_text(token_id, chosen, tokenizer)
        tops = [
            TopLogprob(
                token=(t := _token_text(tid, lp, tokenizer)),
                logprob=lp.logprob,
                bytes=list(t.encode()),
            )
            for tid, lp in _top(entry, top_n)
        ]
        content.append(
            TokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)


def _flatten_content(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: content as one string."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise _bad_request(
                    f"content parts of type {part.get('type')!r} are not supported; "
                    "this server accepts text only",
                    "messages",
                )
            texts.append(str(part.get("text", "")))
        data["content"] = "".join(texts)
    elif content is None:
        data["content"] = ""
    return data


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            merged.put_nowait((index, exc))
        finally:
            merged.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: only valid once the body has been read; later receives report the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, cancelling it (and raising _ClientGone) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise _ClientGone


class _Timing:
    """Feeds time-to-first-token, inter-token latency and finish reasons of one HTTP request."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: dict[int, float] = {}
        self.tokens: dict[tuple[int, int], int] = {}

    def observe(self, stream_index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        if output.finished:
            for out in output.outputs:
                self.metrics.requests_finished.labels(out.finish_reason or "abort").inc()
        new = 0
        for out in output.outputs:
            key = (stream_index, out.index)
            new = max(new, len(out.token_ids) - self.tokens.get(key, 0))
            self.tokens[key] = len(out.token_ids)
        if new == 0:
            return
        last = self.last.get(stream_index)
        if last is None:
            self.metrics.time_to_first_token.observe(now - self.start)
            new -= 1
        else:
            for _ in range(new):
                self.metrics.inter_token_latency.observe((now - last) / new)
        self.last[stream_index] = now


class _EventStreamResponse(StreamingResponse):
    """SSE response that runs `on_close` however it ends, even if never iterated."""

    def __init__(self, body: AsyncIterator[str], on_close: Any) -> None:
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


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


# ----------------------------------------------------------------------------- app


def build_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The HTTP app. Its lifespan starts the engine's step thread and stops it on shutdown.

    `served_model_name`: the name(s) clients put in `model` (default: the engine's model
    name); the first one is reported in responses.
    """
    if served_model_name is None:
        names = [async_engine.model_name]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name) or [async_engine.model_name]
    model_name = names[0]
    tokenizer = async_engine.tokenizer
    metrics = ServerMetrics(async_engine.stats)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="ssmserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        # Added last, so it runs first: unauthenticated bodies are never read.
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    # ------------------------------------------------------------- error handlers

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(_bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(RequestAbortedError)
    async def _on_aborted(request: Request, exc: RequestAbortedError) -> JSONResponse:
        return _error_response(APIError(503, str(exc), type="server_error"))

    @app.exception_handler(EngineDeadError)
    async def _on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_response(_server_error(str(exc)))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(_server_error(f"internal error: {type(exc).__name__}: {exc}"))

    # ------------------------------------------------------------- shared steps

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves "
                + ", ".join(f"`{n}`" for n in names),
                param="model",
                code="model_not_found",
            )

    def render_chat(
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        if not getattr(tokenizer, "chat_template", None):
            raise _bad_request(
                f"the model `{model_name}` has no chat template, so /v1/chat/completions "
                "cannot turn messages into a prompt; use /v1/completions with a plain prompt",
                "messages",
            )
        conversation = [_flatten_content(m) for m in messages]
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 - template errors describe bad messages
            message = f"the chat template rejected the messages: {exc}"
            raise _bad_request(message, "messages") from exc
        # The template already holds any BOS the model wants.
        return text, tokenizer(text, add_special_tokens=False).input_ids

    def _check_context_length(prompts: list[Any], max_tokens: int) -> None:
        """As OpenAI and vLLM do: 400 when prompt + max_tokens exceeds the context.
        (Prompts longer than the context on their own get the engine's message.)"""
        limit = async_engine.max_model_len
        for prompt in prompts:
            if isinstance(prompt, str):
                n = len(tokenizer(prompt).input_ids)
            else:
                n = len(prompt["prompt_token_ids"])
            if n < limit < n + max_tokens:
                raise _bad_request(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in "
                    "the completion). Please reduce the length of the prompt or completion.",
                    "max_tokens",
                )

    async def add_requests(
        request_id: str, prompts: list[Any], params: SamplingParams
    ) -> list[RequestStream]:
        if params.max_tokens is not None:
            _check_context_length(prompts, params.max_tokens)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await async_engine.add_request(sub_id, prompt, params))
        except BaseException as exc:
            _abort_all(streams)
            if isinstance(exc, ValueError):
                raise _bad_request(str(exc), "prompt") from exc
            if isinstance(exc, Exception) and not isinstance(exc, (EngineDeadError, APIError)):
                message = f"could not add the request: {type(exc).__name__}: {exc}"
                raise _server_error(message) from exc
            raise
        return streams

    async def collect(streams: list[RequestStream], timing: _Timing) -> list[RequestOutput | None]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in _merge(streams):
            timing.observe(index, output)
            finals[index] = output
        return finals

    def streaming_response(
        request_id: str, events: AsyncIterator[str], streams: list[RequestStream]
    ) -> StreamingResponse:
        """SSE of `events`; a failure becomes an error event; always ends with [DONE]."""

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                logger.warning("stream %s failed: %s", request_id, exc)
                yield _sse_error(exc)
            yield "data: [DONE]\n\n"

        return _EventStreamResponse(body(), on_close=lambda: _abort_all(streams))

    async def collect_final(
        raw: Request, streams: list[RequestStream], timing: _Timing
    ) -> list[RequestOutput] | None:
        """Each stream's last output, or None if the client went away first."""
        try:
            return await _unless_disconnected(raw, collect(streams, timing))
        except _ClientGone:
            return None
        finally:
            _abort_all(streams)

    # ------------------------------------------------------------- routes

    @app.get("/health")
    async def health() -> Response:
        if async_engine.dead_error is not None:
            raise APIError(503, str(async_engine.dead_error), type="server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        root, limit = async_engine.model_name, async_engine.max_model_len
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=limit) for n in names])

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad_request("send exactly one of `prompt` and `messages`", "prompt")
        if req.messages is not None:
            _, ids = render_chat(req.messages, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        limit = async_engine.max_model_len
        return TokenizeResponse(count=len(ids), max_model_len=limit, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(req.model)
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise _bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))

    @app.post("/v1/completions", response_model=None)
    async def create_completion(req: CompletionRequest, raw: Request) -> Any:
        check_model(req.model)
        if req.suffix:
            raise _bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise _bad_request("best_of is not supported (it must equal n)", "best_of")
        prompts = _completion_prompts(req.prompt)
        echo_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = _sampling_params(
            req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=echo_logprobs
        )
        engine_prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        timing = _Timing(metrics)
        streams = await add_requests(request_id, engine_prompts, params)

        def prompt_text(index: int, output: RequestOutput) -> str:
            if isinstance(prompts[index], str):
                return prompts[index]
            return (
                output.prompt
                if output.prompt is not None
                else tokenizer.decode(output.prompt_token_ids)
            )

        def choice_payload(
            index: int,
            output: RequestOutput,
            out: Any,
            start_char: int,
            start_token: int,
            offset: int,
            first: bool,
        ) -> tuple[str, CompletionLogprobs | None, int]:
            """Text and logprobs of `out` from the given positions, and the next text_offset.

            The `first` payload of a choice carries the echoed prompt."""
            text = out.text[start_char:]
            if req.echo and first:
                text = prompt_text(index, output) + text
            if req.logprobs is None:
                return text, None, offset
            logprobs = CompletionLogprobs()
            if req.echo and first and output.prompt_logprobs is not None:
                offset = _legacy_logprobs(
                    output.prompt_token_ids,
                    output.prompt_logprobs,
                    req.logprobs,
                    tokenizer,
                    offset,
                    logprobs,
                )
            offset = _legacy_logprobs(
                out.token_ids[start_token:],
                (out.logprobs or [])[start_token:],
                req.logprobs,
                tokenizer,
                offset,
                logprobs,
            )
            return text, logprobs, offset

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            exclude = None if include_usage else {"usage"}

            async def events() -> AsyncIterator[str]:
                sent_chars: dict[int, int] = {}
                sent_tokens: dict[int, int] = {}
                offsets: dict[int, int] = {}  # next text_offset per choice
                done: set[int] = set()
                prompt_tokens = [0] * len(streams)
                async for index, output in _merge(streams):
                    timing.observe(index, output)
                    prompt_tokens[index] = len(output.prompt_token_ids)
                    for out in output.outputs:
                        choice = index * req.n + out.index
                        if choice in done:
                            continue
                        start_char = sent_chars.get(choice, 0)
                        start_token = sent_tokens.get(choice, 0)
                        has_new = len(out.token_ids) > start_token or out.finish_reason is not None
                        # With echo, the prompt goes out first, once its logprobs (if
                        # asked for) are complete.
                        echo_ready = (
                            req.echo
                            and choice not in sent_chars
                            and (req.logprobs is None or output.prompt_logprobs is not None)
                        )
                        if not has_new and not echo_ready:
                            continue
                        text, logprobs, offsets[choice] = choice_payload(
                            index,
                            output,
                            out,
                            start_char,
                            start_token,
                            offsets.get(choice, 0),
                            first=choice not in sent_chars,
                        )
                        sent_chars[choice] = len(out.text)
                        sent_tokens[choice] = len(out.token_ids)
                        if out.finish_reason is not None:
                            done.add(choice)
                        chunk = CompletionResponse(
                            id=request_id,
                            created=created,
                            model=model_name,
                            choices=[
                                CompletionChoice(
                                    index=choice,
                                    text=text,
                                    logprobs=logprobs,
                                    finish_reason=out.finish_reason,
                                    stop_reason=out.stop_reason,
                                )
                            ],
                        )
                        yield _sse(chunk, exclude)
                if include_usage:
                    usage = _usage(sum(prompt_tokens), sum(sent_tokens.values()))
                    chunk = CompletionResponse(
                        id=request_id,
                        created=created,
                        model=model_name,
                        choices=[],
                        usage=usage,
                    )
                    yield _sse(chunk)

            return streaming_response(request_id, events(), streams)

        finals = await collect_final(raw, streams, timing)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, output in enumerate(finals):
            assert output is not None
            prompt_tokens += len(output.prompt_token_ids)
            for out in output.outputs:
                completion_tokens += len(out.token_ids)
                text, logprobs, _ = choice_payload(index, output, out, 0, 0, 0, first=True)
                choices.append(
                    CompletionChoice(
                        index=index * req.n + out.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model_name,
            choices=choices,
            usage=_usage(prompt_tokens, completion_tokens),
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Any:
        check_model(req.model)
        if req.tools:
            raise _bad_request("tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise _bad_request(
                'only response_format {"type": "text"} is supported', "response_format"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise _bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        # In a worker thread: a long conversation must not stall every other stream.
        prompt_text, prompt_ids = await asyncio.to_thread(
            render_chat,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
        )
        top_n = req.top_logprobs or 0
        params = _sampling_params(
            req,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=top_n if req.logprobs else None,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        timing = _Timing(metrics)
        engine_prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        streams = await add_requests(request_id, [engine_prompt], params)

        def logprobs_of(out: Any, start: int) -> ChatLogprobs | None:
            if not req.logprobs:
                return None
            return _chat_logprobs(
                out.token_ids[start:], (out.logprobs or [])[start:], top_n, tokenizer
            )

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            exclude = None if include_usage else {"usage"}

            def chunk(choice: ChatChunkChoice) -> str:
                return _sse(
                    ChatCompletionChunk(
                        id=request_id, created=created, model=model_name, choices=[choice]
                    ),
                    exclude,
                )

            async def events() -> AsyncIterator[str]:
                sent_chars: dict[int, int] = {}
                sent_tokens: dict[int, int] = {}
                done: set[int] = set()
                for i in range(req.n):
                    yield chunk(
                        ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                    )
                async for _, output in _merge(streams):
                    timing.observe(0, output)
                    for out in output.outputs:
                        if out.index in done:
                            continue
                        start_char = sent_chars.get(out.index, 0)
                        start_token = sent_tokens.get(out.index, 0)
                        if len(out.token_ids) == start_token and out.finish_reason is None:
                            continue
                        sent_chars[out.index] = len(out.text)
                        sent_tokens[out.index] = len(out.token_ids)
                        if out.finish_reason is not None:
                            done.add(out.index)
                        yield chunk(
                            ChatChunkChoice(
                                index=out.index,
                                delta=DeltaMessage(content=out.text[start_char:]),
                                logprobs=logprobs_of(out, start_token),
                                finish_reason=out.finish_reason,
                                stop_reason=out.stop_reason,
                            )
                        )
                if include_usage:
                    usage = _usage(len(prompt_ids), sum(sent_tokens.values()))
                    yield _sse(
                        ChatCompletionChunk(
                            id=request_id,
                            created=created,
                            model=model_name,
                            choices=[],
                            usage=usage,
                        )
                    )

            return streaming_response(request_id, events(), streams)

        finals = await collect_final(raw, streams, timing)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        output = finals[0]
        assert output is not None
        choices = [
            ChatChoice(
                index=out.index,
                message=AssistantMessage(content=out.text),
                logprobs=logprobs_of(out, 0),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in output.outputs
        ]
        completion_tokens = sum(len(out.token_ids) for out in output.outputs)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model_name,
            choices=choices,
            usage=_usage(len(output.prompt_token_ids), completion_tokens),
        )

    return app


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The request's prompts: one text, several texts, one token list or several."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return list(prompt)
    if any(len(p) == 0 for p in prompt):
        raise _bad_request("token-id prompts must not be empty", "prompt")
    return [list(p) for p in prompt]
