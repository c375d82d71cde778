"""Fixtures: a tiny Bamba checkpoint (attention + Mamba2, so both cache pools are used) and
real uvicorn servers over it on 127.0.0.1, each in a background thread; `ServerProcess`
for `ssmserve serve` as a process."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from ssmserve.config import EngineConfig
from ssmserve.engine.engine import LLMEngine
from ssmserve.server.app import DrainingServer, build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.options import ServerOptions

MODEL_NAME = "tiny-bamba"
MAX_MODEL_LEN = 512
API_KEY = "sk-test-key"


def engine_kwargs() -> dict:
    # Enough blocks and slots for 32 concurrent requests without preemption noise.
    return dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=48)


def make_engine(checkpoint: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=checkpoint, **engine_kwargs()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`ssmserve serve [CHECKPOINT] --port 0 FLAGS...` as a child process, up and healthy;
    its output is collected in `lines`. The server binds a free port itself and names it
    in its start-up lines, so no other process can take it in between."""

    def __init__(self, checkpoint: str | None, *flags: str, timeout: float = 120) -> None:
        cmd = [sys.executable, "-m", "ssmserve.cli", "serve"]
        cmd += [checkpoint] if checkpoint else []
        cmd += ["--port", "0", "--device", "cpu", "--uvicorn-log-level", "warning", *flags]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.base_url = ""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError("the server exited early:\n" + "".join(self.lines))
            if not self.base_url:
                urls = [re.search(r"OpenAI API at (\S+)/v1 ", line) for line in self.lines]
                self.base_url = next((u.group(1) for u in urls if u), "")
            try:
                if self.base_url and httpx.get(self.base_url + "/health", timeout=1).is_success:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("the server did not come up:\n" + "".join(self.lines))
            time.sleep(0.2)
        self.port = int(self.base_url.rsplit(":", 1)[1])

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ServerThread:
    """The server `ssmserve serve` runs, for `app` on a free port of 127.0.0.1, in a daemon
    thread (no signals there: `should_exit` stops it as SIGTERM would)."""

    def __init__(self, app) -> None:
        self.app = app
        # Bound here and handed to uvicorn, so no other process can take the port first.
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=app.state.serving.options.shutdown_timeout,
        )
        self.server = DrainingServer(config, app)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits; return the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["ssmserve:num_requests_running"] == 0
                and m["ssmserve:num_requests_waiting"] == 0
                and m["ssmserve:kv_blocks_used"] == 0
                and m["ssmserve:state_slots_used"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@pytest.fixture(scope="session")
def bamba_checkpoint(checkpoint) -> str:
    """The tiny Bamba of tests/conftest.py (attention + Mamba2 layers)."""
    return checkpoint("bamba")


@pytest.fixture(scope="session")
def checkpoint_without_chat_template(bamba_checkpoint, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "bamba-no-template")
    shutil.copytree(bamba_checkpoint, path)
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(template_file):
        os.remove(template_file)
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        tokenizer_config = json.load(f)
    tokenizer_config.pop("chat_template", None)
    with open(config_file, "w") as f:
        json.dump(tokenizer_config, f)
    return path


@pytest.fixture(scope="session")
def engine(bamba_checkpoint):
    """The engine behind the shared server (tests may read its tokenizer, never step it)."""
    return make_engine(bamba_checkpoint)


@pytest.fixture(scope="session")
def server(engine) -> Iterator[ServerThread]:
    app = build_app(AsyncLLMEngine(engine), MODEL_NAME, options=ServerOptions(shutdown_timeout=5))
    with ServerThread(app) as handle:
        yield handle


@pytest.fixture(scope="session")
def guarded_server(checkpoint_without_chat_template) -> Iterator[ServerThread]:
    """A server with an API key, a 64 KiB body limit and a model without a chat template."""
    engine = make_engine(checkpoint_without_chat_template)
    options = ServerOptions(max_request_body_bytes=65536, shutdown_timeout=5)
    app = build_app(AsyncLLMEngine(engine), MODEL_NAME, api_key=API_KEY, options=options)
    with ServerThread(app) as handle:
        yield handle
