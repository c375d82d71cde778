"""`ssmserve serve`: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.server.app import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)

API_KEY_ENV = "SSMSERVE_API_KEY"


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; return its parser."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible HTTP API",
        description="Serve MODEL (a checkpoint folder or a hub id in the local Hugging Face "
        "cache; default: the bundled tiny model) behind an OpenAI-compatible HTTP API.",
    )
    add_serve_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint folder or cached hub id (default: the bundled model)",
    )
    parser.add_argument(
        "--model", default=None, help="same as the positional MODEL (vLLM accepts both)"
    )
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)",
    )
    g.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and "
        f"/detokenize (default: ${API_KEY_ENV}, or no key)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use in `model`; the first is reported (default: MODEL as given)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default 16 MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before they "
        "are aborted (default 30)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="log level of uvicorn's server and access logs (default info)",
    )
    add_engine_args(parser)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine, then serve until SIGINT/SIGTERM; return the exit code."""
    import uvicorn

    from ssmserve.server.app import build_app
    from ssmserve.server.async_engine import AsyncLLMEngine

    if args.model_tag and args.model and args.model_tag != args.model:
        print(
            f"error: two different models given ({args.model_tag!r} and --model "
            f"{args.model!r}); pass one",
            file=sys.stderr,
        )
        return 2
    model = args.model_tag or args.model
    try:
        config = EngineConfig.from_args(args, model=model)
        async_engine = AsyncLLMEngine.from_config(config)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = args.served_model_name or [model or async_engine.model_name]
    app = build_app(
        async_engine, names, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes
    )
    logger.info(
        "serving %s as %s on http://%s:%d",
        model or "the bundled model",
        ", ".join(names),
        args.host,
        args.port,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, waits up to the shutdown timeout
    # for in-flight responses, cancels the rest (which aborts them), then runs the app's
    # lifespan shutdown, which stops the engine thread. Afterwards it re-raises the signal
    # to the handler it found; ours makes that a no-op, so a clean shutdown exits 0.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _after_graceful_shutdown)
    server.run()
    logger.info("server stopped")
    return 0


def _after_graceful_shutdown(sig: int, frame: Any) -> None:
    logger.debug("%s handled by a graceful shutdown", signal.Signals(sig).name)


def main(argv: list[str] | None = None) -> int:
    """`python -m ssmserve.server.cli [MODEL] ...`: the serve command on its own."""
    parser = argparse.ArgumentParser(prog="ssmserve serve")
    add_serve_args(parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
