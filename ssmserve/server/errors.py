"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the
FastAPI exception handlers that turn every failure into one."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssmserve.engine.engine import RequestFailedError
from ssmserve.server.async_engine import EngineDeadError, RequestAbortedError
from ssmserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


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


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def error_body(message: str, **fields: Any) -> bytes:
    info = ErrorInfo(message=message, type=fields.pop("type", "invalid_request_error"), **fields)
    return ErrorResponse(error=info).model_dump_json().encode()


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=exc.info).model_dump(), status_code=exc.status_code)


def error_info(exc: BaseException) -> ErrorInfo:
    """The OpenAI error fields of any exception, for an error event inside a stream."""
    if isinstance(exc, APIError):
        return exc.info
    if isinstance(exc, (EngineDeadError, RequestFailedError)):
        return ErrorInfo(message=str(exc), type="server_error", code="internal_error")
    if isinstance(exc, RequestAbortedError):
        return ErrorInfo(message=str(exc), type="server_error", code="request_aborted")
    return ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="server_error")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence per offending field; `param` is the first top-level field."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        # FastAPI puts the character offset where the field name would be.
        where = errors[0].get("loc", ("body", "?"))[-1]
        reason = (errors[0].get("ctx") or {}).get("error", "malformed JSON")
        return f"the request body is not valid JSON: {reason} (at character {where})", None
    by_field: dict[str, list[dict[str, Any]]] = {}
    for err in errors:
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


def install_error_handlers(app: FastAPI) -> None:
    """Every exception a route can raise becomes an OpenAI-shaped JSON error."""

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = error_response(APIError(exc.status_code, str(exc.detail), type=kind))
        response.headers.update(exc.headers or {})  # 405 carries Allow
        return response

    @app.exception_handler(RequestAbortedError)
    async def _on_aborted(request: Request, exc: RequestAbortedError) -> JSONResponse:
        return error_response(APIError(503, str(exc), type="server_error"))

    @app.exception_handler(RequestFailedError)
    async def _on_request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(server_error(str(exc)))

    @app.exception_handler(EngineDeadError)
    async def _on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(server_error(str(exc)))

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(server_error(f"internal error: {type(exc).__name__}: {exc}"))
