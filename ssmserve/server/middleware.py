"""ASGI middleware: the API key check and the request body limit."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ssmserve.server.errors import error_body

# Paths that need the bearer token when the server has an API key; /health and /metrics
# stay open for load balancers and scrapers.
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on the protected paths."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            # The scheme is case-insensitive (RFC 9110); the key is compared exactly.
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(key, self.expected):
                message = (
                    "incorrect or missing API key; send the header `Authorization: Bearer <key>`"
                )
                body = error_body(message, code="invalid_api_key")
                await send_json(send, 401, body)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
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
        await send_json(send, 413, error_body(message, code="request_too_large"))


async def send_json(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
