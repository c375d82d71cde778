"""`ssmserve serve` as a process: the docs' client example, flags, graceful shutdown."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.cli import add_serve_args
from tests.server.conftest import MODEL_NAME, ServerThread, free_port, make_engine

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def served_process(bamba_checkpoint):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ssmserve.cli",
        "serve",
        bamba_checkpoint,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-model-len",
        "512",
        "--shutdown-timeout",
        "20",
        "--uvicorn-log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(DOCS.parents[1])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{proc.stdout.read().decode()}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not come up")
        time.sleep(0.2)
    yield proc, base_url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_docs_client_example_runs_as_written(served_process):
    _, base_url = served_process
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    example = blocks[0]
    # The only change: the port this test's server got instead of the default 8000.
    assert example.count("http://localhost:8000/v1") == 1
    example = example.replace("http://localhost:8000", base_url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example, str(DOCS), "exec"), {})
    printed = out.getvalue()
    assert re.search(r"\[\d+ tokens\]", printed), printed
    # The extra_body snippet runs with the example's client and model.
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    exec(compile(blocks[1], str(DOCS), "exec"), {"client": client, "model": model})


def test_readme_client_example_runs_as_written(served_process):
    _, base_url = served_process
    readme = DOCS.parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    example = next(b for b in blocks if "OpenAI(" in b)
    assert example.count("http://localhost:8000/v1") == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example.replace("http://localhost:8000", base_url), str(readme), "exec"), {})
    assert out.getvalue().strip(), "the README example printed nothing"


def test_docs_list_every_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    docs = DOCS.read_text()
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    missing = [f for f in flags if f"`{f}" not in docs and f != "--help"]
    assert not missing, f"docs/serving.md does not describe {missing}"


def test_sigterm_lets_in_flight_stream_finish_then_exits(served_process):
    proc, base_url = served_process
    body = {
        "model": MODEL_NAME,
        "prompt": "def fib(n):",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream():
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk.set()

    # The served name is the bamba_checkpoint path as given; the test asks for that.
    body["model"] = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(60)
    proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert lines[-1] == "data: [DONE]"
    finish = [line for line in lines if '"finish_reason":"length"' in line]
    assert len(finish) == 1, "the in-flight request ran to its end"
    assert proc.wait(60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(base_url + "/health", timeout=2)


def test_shutdown_timeout_aborts_what_is_left(bamba_checkpoint):
    engine = make_engine(bamba_checkpoint)
    real_step = engine.step

    def slow_step():
        time.sleep(0.05)
        return real_step()

    engine.step = slow_step
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, MODEL_NAME)
    srv = ServerThread(app)
    srv.server.config.timeout_graceful_shutdown = 1
    body = {
        "model": MODEL_NAME,
        "prompt": "def fib(n):",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with srv:
        got_chunk = threading.Event()
        ended = threading.Event()

        def stream():
            try:
                with httpx.stream("POST", srv.base_url + "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        got_chunk.set()
            except httpx.TransportError:
                pass
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        assert got_chunk.wait(30)
        start = time.monotonic()
        srv.server.should_exit = True
        srv.thread.join(30)
        assert not srv.thread.is_alive()
        assert time.monotonic() - start < 6  # 400 tokens x 50 ms would take 20 s
        assert ended.wait(10)
    stats = async_engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
