"""The OpenAI-compatible HTTP app over an AsyncLLMEngine (FastAPI).

`build_app(async_engine, served_model_name, api_key)` returns an ASGI app; `cli.run_serve`
runs it under uvicorn. The endpoints live in `completions.py` and `chat.py` (over the shared
`serving.ServingContext` and `streaming.StreamState`); this module wires them to routes,
with the middleware, the error handlers and the engine's lifespan. Streams are Server-Sent
Events, one `data: {json}` per chunk and `data: [DONE]` at the end. Errors use OpenAI's
shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ssmserve.server.async_engine import AsyncLLMEngine, ServerStoppingError
from ssmserve.server.chat import Chat
from ssmserve.server.completions import Completions
from ssmserve.server.errors import APIError, bad_request, install_error_handlers
from ssmserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from ssmserve.server.options import ServerOptions
from ssmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ssmserve.server.serving import ServingContext


def build_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The HTTP app. Its lifespan starts the engine's step thread and stops it on shutdown;
    `begin_shutdown(app)` starts the clock that cuts requests still running at the
    shutdown timeout.

    `served_model_name`: the name(s) clients put in `model` (default: the engine's model
    name); the first one is reported in responses.
    """
    ctx = ServingContext(async_engine, served_model_name, options)
    options = ctx.options
    completions = Completions(ctx)
    chat = Chat(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            cut = app.state.shutdown_cut
            if cut is not None:
                cut.cancel()
            await async_engine.shutdown()
            ctx.close()

    app = FastAPI(title="ssmserve", lifespan=lifespan)
    app.openapi = _openapi_without_422(app)
    app.state.serving = ctx
    app.state.shutdown_cut = None
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_body_bytes)
    if api_key:
        # Added last, so it runs first: unauthenticated bodies are never read.
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.dead_error is not None:
            raise APIError(503, str(async_engine.dead_error), type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        root, limit = async_engine.model_name, ctx.max_model_len
        return ModelList(data=[ModelCard(id=n, root=root, max_model_len=limit) for n in ctx.names])

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of `prompt` and `messages`", "prompt")
        if req.messages is not None:
            _, ids = await chat.render(
                req.messages, add_generation_prompt=req.add_generation_prompt, for_generation=False
            )
        else:
            ids = await ctx.tokens.tokenize(req.prompt, req.add_special_tokens)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(req.model)
        vocab = len(ctx.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=await ctx.pool.run(ctx.tokenizer.decode, req.tokens))

    if options.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(ctx.tokens.info())

    @app.post("/v1/completions", response_model=None)
    async def create_completion(req: CompletionRequest, raw: Request) -> Any:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Any:
        return await chat.create(req, raw)

    return app


def shutdown_cut_after(timeout: float) -> float:
    """Seconds after shutdown begins at which requests still running are cut: late enough
    to let them finish, early enough that their errors go out and the process is gone
    within `timeout` (the interpreter's teardown of torch alone takes seconds on a busy
    machine, so the margin is a quarter of the timeout, at most 5 s)."""
    return timeout - min(5.0, timeout / 4)


def begin_shutdown(app: FastAPI) -> None:
    """The server stopped accepting: at `shutdown_cut_after(--shutdown-timeout)` seconds,
    fail what still runs (streams end with an error event and [DONE], the others get 503)
    and refuse new requests. Call on the app's event loop."""
    ctx: ServingContext = app.state.serving
    timeout = ctx.options.shutdown_timeout

    async def cut() -> None:
        await asyncio.sleep(shutdown_cut_after(timeout))
        ctx.async_engine.stop_requests(
            ServerStoppingError(
                "the server is shutting down and the request did not finish within its "
                f"shutdown timeout of {timeout:g} s; retry it"
            )
        )

    if app.state.shutdown_cut is None:
        app.state.shutdown_cut = asyncio.ensure_future(cut())


def _openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI documents its validation errors as 422 with its own schema; this server
    answers them with 400 in the OpenAI error shape, so the document says that."""
    build = app.openapi
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    invalid = {
        "description": "Invalid request",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = invalid
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            schemas.update(error_schema.get("$defs", {}))
            schemas["ErrorResponse"] = {k: v for k, v in error_schema.items() if k != "$defs"}
        return app.openapi_schema

    return openapi


class DrainingServer(uvicorn.Server):
    """uvicorn's server; as it stops accepting connections it starts the app's shutdown
    clock (`ssmserve.server.app.begin_shutdown`), so requests still running near
    --shutdown-timeout end with an error instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets: Any = None) -> None:
        begin_shutdown(self._app)
        await super().shutdown(sockets)
