"""`ssmserve serve`: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.server.options import ServerOptions

logger = logging.getLogger(__name__)

API_KEY_ENV = "SSMSERVE_API_KEY"

# Help of the flags made from ServerOptions' fields (--max-n for max_n, ...).
_OPTION_HELP = {
    "max_n": "most samples (`n`) one request may ask for",
    "max_prompts_per_request": "most prompts in one /v1/completions request",
    "max_stop_strings": "most stop strings in one request",
    "max_stop_string_length": "most characters in one stop string",
    "max_request_body_bytes": "larger request bodies get 413",
    "tokenizer_pool_size": "threads that tokenize prompts and render chat templates",
    "trust_request_chat_template": "run chat templates sent in requests (`chat_template`, "
    "`chat_template_kwargs.chat_template`), sandboxed and time-limited; refused by default",
    "chat_template_timeout": "seconds a request's chat template may take to render",
    "enable_tokenizer_info_endpoint": "serve GET /tokenizer_info (lm-eval's remote tokenizer "
    "uses it)",
    "shutdown_timeout": "on SIGTERM, the process is gone within this many seconds; requests "
    "still running near the end are cut (streams get an error event and [DONE], others 503)",
}


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
    g.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port to bind (default 8000; 0: a free one, named in the start-up lines)",
    )
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
    for f in dataclasses.fields(ServerOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            g.add_argument(flag, action="store_true", help=_OPTION_HELP[f.name])
        else:
            kind = int if f.type == "int" else float
            g.add_argument(
                flag,
                type=kind,
                default=f.default,
                help=f"{_OPTION_HELP[f.name]} (default %(default)s)",
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
    # Imported here: `ssmserve generate` and `bench` need neither FastAPI nor uvicorn.
    import uvicorn

    from ssmserve.server.app import DrainingServer, build_app
    from ssmserve.server.async_engine import AsyncLLMEngine

    if args.model_tag and args.model and args.model_tag != args.model:
        print(
            f"error: two different models given ({args.model_tag!r} and --model "
            f"{args.model!r}); pass one",
            file=sys.stderr,
        )
        return 2
    model = args.model_tag or args.model
    # Bound before the engine loads: a busy port fails at once, and tensor-parallel
    # workers' ephemeral gloo ports can never take it while the model loads.
    try:
        sock = _bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    try:
        options = ServerOptions(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerOptions)}
        )
        config = EngineConfig.from_args(args, model=model)
        async_engine = AsyncLLMEngine.from_config(config)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = args.served_model_name or [model or async_engine.model_name]
    app = build_app(async_engine, names, api_key=args.api_key, options=options)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}"
    for line in _startup_lines(async_engine.engine, names, url):
        print(f"ssmserve: {line}", file=sys.stderr, flush=True)
    # No host or port: uvicorn serves on `sock`, bound above.
    uvicorn_config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        # A backstop: the app cuts what still runs shortly before this.
        timeout_graceful_shutdown=options.shutdown_timeout,
    )
    server = DrainingServer(uvicorn_config, app)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, waits for in-flight responses
    # (the app cuts those still running just before --shutdown-timeout), then runs the
    # app's lifespan shutdown, which stops the engine thread. Afterwards it re-raises the
    # signal to the handler it found; ours makes that a no-op, so a clean shutdown exits 0.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _after_graceful_shutdown)
    server.run(sockets=[sock])
    logger.info("server stopped")
    return 0


def _bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one), as uvicorn would bind it."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _startup_lines(engine: Any, names: list[str], url: str) -> list[str]:
    """What is served, where it runs, its cache plan and its URL."""
    plan = engine.cache_plan
    return [
        f"model {engine.model_config.path} ({engine.model_config.architecture}), "
        f"served as {', '.join(names)}",
        f"device {engine.device}, {str(engine.dtype).removeprefix('torch.')}, "
        f"max_model_len {engine.model_config.max_model_len}",
        f"cache: {plan.num_kv_blocks} KV blocks of {engine.config.block_size} tokens, "
        f"{plan.num_state_slots} state slots, up to {plan.max_num_seqs} requests at once",
        f"OpenAI API at {url}/v1 (health: {url}/health)",
    ]


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
