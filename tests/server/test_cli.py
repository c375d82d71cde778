"""`ssmserve serve` as a process: the docs' client example, flags, graceful shutdown."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from ssmserve.server.app import build_app, shutdown_cut_after
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.cli import add_serve_args
from ssmserve.server.options import ServerOptions
from tests.server.conftest import MODEL_NAME, ServerProcess, ServerThread, make_engine

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@pytest.fixture(scope="module")
def served_process(bamba_checkpoint):
    server = ServerProcess(bamba_checkpoint, "--max-model-len", "512", "--shutdown-timeout", "20")
    yield server.proc, server.base_url, server
    server.kill()


def test_docs_client_example_runs_as_written(served_process):
    _, base_url, _ = served_process
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
    _, base_url, _ = served_process
    readme = DOCS.parents[1] / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    example = next(b for b in blocks if "OpenAI(" in b)
    assert example.count("http://localhost:8000/v1") == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(example.replace("http://localhost:8000", base_url), str(readme), "exec"), {})
    assert out.getvalue().strip(), "the README example printed nothing"


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser


def test_docs_list_every_flag():
    docs = DOCS.read_text()
    flags = [s for a in _serve_parser()._actions for s in a.option_strings if s.startswith("--")]
    # The flag itself in backticks, not a longer flag it begins.
    missing = [f for f in flags if not re.search(f"`{f}[` ]", docs) and f != "--help"]
    assert not missing, f"docs/serving.md does not describe {missing}"


def test_every_serve_flag_has_help():
    actions = [a for a in _serve_parser()._actions if a.option_strings or a.dest == "model_tag"]
    assert [a.dest for a in actions if not (a.help or "").strip()] == []


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(DOCS.parents[1])}
    cmd = [sys.executable, "-m", "ssmserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_version_and_bad_log_level():
    import ssmserve

    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ssmserve {ssmserve.__version__}"
    bad = _cli("--log-level", "loud", "serve")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "error: --log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got 'loud'"
    ]


def test_a_busy_port_fails_before_the_model_loads(tmp_path):
    # The port is bound first, so the error names it although the model does not exist.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        missing = str(tmp_path / "no-such-model")
        result = _cli("serve", missing, "--port", str(port), "--device", "cpu")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), result.stderr
    assert "no-such-model" not in result.stderr


def test_startup_lines_name_model_device_cache_and_url(served_process, bamba_checkpoint):
    _, base_url, server = served_process
    startup = "".join(line for line in server.lines if line.startswith("ssmserve: "))
    assert f"model {bamba_checkpoint} (BambaForCausalLM)" in startup, startup
    assert "device cpu, float32" in startup and "max_model_len 512" in startup
    assert re.search(r"cache: \d+ KV blocks of 16 tokens, \d+ state slots", startup), startup
    # Served with --port 0: the line names the port the server bound, where it answers.
    url = re.search(r"OpenAI API at http://127\.0\.0\.1:(\d+)/v1 \(health: (\S+)\)", startup)
    assert url and int(url.group(1)) > 0, startup
    assert httpx.get(url.group(2), timeout=5).json() == {"status": "ok"}


def test_sigterm_lets_in_flight_stream_finish_then_exits(served_process):
    proc, base_url, _ = served_process
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


def _in_flight(base_url: str, body: dict, plain_n: int = 1) -> dict:
    """A streamed request, and once its first chunk is in, a plain one (of `plain_n`
    samples), both running in threads; returns what each got, filled in as it arrives."""
    got: dict = {"stream": [], "plain": None}
    first_chunk = threading.Event()

    def stream() -> None:
        url = base_url + "/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    got["stream"].append(line)
                    first_chunk.set()

    def plain() -> None:
        plain_body = {**body, "n": plain_n}
        got["plain"] = httpx.post(base_url + "/v1/completions", json=plain_body, timeout=60)

    threading.Thread(target=stream, daemon=True).start()
    assert first_chunk.wait(60)
    threading.Thread(target=plain, daemon=True).start()
    return got


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(f"ssmserve:{name} "):
            return float(line.split()[-1])
    raise KeyError(name)


def _assert_cut_cleanly(got: dict, timeout: float) -> None:
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"] and f"{timeout:g} s" in error["message"]
    assert error["type"] == "server_error"
    plain = got["plain"]
    assert plain is not None and plain.status_code == 503, plain
    error = plain.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "shutting down" in error["message"]


def test_shutdown_timeout_cuts_what_is_left_cleanly(bamba_checkpoint):
    engine = make_engine(bamba_checkpoint)
    real_step = engine.step

    def slow_step():
        time.sleep(0.05)
        return real_step()

    engine.step = slow_step  # 400 tokens take 20 s at least
    async_engine = AsyncLLMEngine(engine)
    timeout = 2.0
    app = build_app(async_engine, MODEL_NAME, options=ServerOptions(shutdown_timeout=timeout))
    body = {"model": MODEL_NAME, "prompt": "def fib(n):", "max_tokens": 400, "ignore_eos": True}
    with ServerThread(app) as srv:
        got = _in_flight(srv.base_url, body)
        while srv.metrics()["ssmserve:num_requests_running"] < 2:
            time.sleep(0.02)
        start = time.monotonic()
        srv.server.should_exit = True  # what SIGTERM does
        srv.thread.join(30)
        took = time.monotonic() - start
        assert not srv.thread.is_alive()
        assert shutdown_cut_after(timeout) <= took < timeout
    time.sleep(0.2)  # the client threads read the last bytes
    _assert_cut_cleanly(got, timeout)
    stats = async_engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0


def test_sigterm_cuts_cleanly_and_the_process_exits_within_the_timeout(bamba_checkpoint):
    timeout = 20.0  # cut at 15 s: 5 s for the interpreter's teardown on a busy machine
    server = ServerProcess(
        bamba_checkpoint,
        *("--max-model-len", "8192", "--max-num-seqs", "1", "--shutdown-timeout", str(timeout)),
    )
    try:
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        # One sequence runs at a time: 9 x 8000 steps outlast the cut at 15 s at any step
        # time above 0.25 ms (a step of the tiny model takes 1 ms or more on CPU).
        body = {"model": model, "prompt": "def fib(n):", "max_tokens": 8000, "ignore_eos": True}
        got = _in_flight(server.base_url, body, plain_n=8)
        while _metric(server.base_url, "num_requests_waiting") < 8:
            time.sleep(0.05)  # the plain request's samples queue behind the stream
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        took = time.monotonic() - start
        assert shutdown_cut_after(timeout) <= took < timeout, "".join(server.lines)
        time.sleep(0.2)
        _assert_cut_cleanly(got, timeout)
    finally:
        server.kill()
