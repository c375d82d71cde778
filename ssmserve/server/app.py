"""The OpenAI-compatible HTTP app over an AsyncLLMEngine (FastAPI).

`build_app(async_engine, served_model_name, api_key)` returns an ASGI app; `cli.run_serve`
runs it under uvicorn. The endpoints live in `completions.py` and `chat.py` (over the shared
`serving.ServingContext` and `streaming.StreamState`); this module wires them to routes,
with the middleware, the error handlers and the engine's lifespan. Streams are Server-Sent
Events, one `data: {json}` per chunk and `data: [DONE]` at the end. Errors use OpenAI's
shape: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.chat import Chat
from ssmserve.server.completions import Completions
from ssmserve.server.errors import APIError, bad_request, install_error_handlers
from ssmserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from ssmserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ssmserve.server.serving import ServingContext

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


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
    ctx = ServingContext(async_engine, served_model_name)
    completions = Completions(ctx)
    chat = Chat(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()

    app = FastAPI(title="ssmserve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = ctx.metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        # Added last, so it runs first: unauthenticated bodies are never read.
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.dead_error is not None:
            raise APIError(503, str(async_engine.dead_error), type="server_error")
        return Response(status_code=200)

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
            _, ids = chat.render(req.messages, add_generation_prompt=req.add_generation_prompt)
        else:
            ids = ctx.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(req.model)
        vocab = len(ctx.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))

    @app.post("/v1/completions", response_model=None)
    async def create_completion(req: CompletionRequest, raw: Request) -> Any:
        return await completions.create(req, raw)

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Any:
        return await chat.create(req, raw)

    return app
