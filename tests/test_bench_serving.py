"""`ssmserve bench serving` against the real server (`ssmserve serve` as a process, the
bundled model, CPU): every request counted, the timings consistent, the JSON and plot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ssmserve.bench.serving import (
    load_prompts,
    random_prompts,
    run_serving,
    served_model,
    summarize_serving,
)
from ssmserve.cli import main
from tests.server.conftest import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server_url():
    server = ServerProcess(None, "--max-model-len", str(MAX_MODEL_LEN))
    yield server.base_url
    server.kill()


def _check_consistent(summary: dict, results: list, max_tokens: int) -> None:
    """What any sound run satisfies, whatever the timings."""
    assert summary["failed"] == 0 and summary["completed"] == summary["num_requests"]
    for r in results:
        assert r.error is None
        assert r.output_tokens == max_tokens  # ignore_eos: exactly what was asked for
        assert 0 <= r.start < r.start + r.ttft <= r.end <= summary["duration_s"]
        assert len(r.chunk_times) >= 1 and r.chunk_times == sorted(r.chunk_times)
        assert r.start + r.ttft == pytest.approx(r.chunk_times[0])
        assert r.chunk_times[-1] <= r.end
    assert summary["output_tokens"] == max_tokens * len(results)
    assert summary["output_throughput"] == pytest.approx(
        summary["output_tokens"] / summary["duration_s"]
    )
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = summary[key]
        assert s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"], key
    assert summary["ttft_s"]["max"] <= summary["e2e_s"]["max"]
    assert summary["e2e_s"]["max"] <= summary["duration_s"]
    gaps = sum(len(r.chunk_times) - 1 for r in results)
    assert sum(1 for r in results for _ in r.itl) == gaps
    cdf = summary["itl_cdf_s"]
    assert cdf == sorted(cdf) and len(cdf) == 101
    assert (cdf[0], cdf[50], cdf[100]) == pytest.approx(
        (summary["itl_s"]["min"], summary["itl_s"]["p50"], summary["itl_s"]["max"])
    )
    # The timeline holds every output token once, and request-seconds in flight add up
    # to the requests' end-to-end times.
    line = summary["timeline"]
    assert sum(line["output_tokens_per_s"]) * line["bin_s"] == pytest.approx(
        summary["output_tokens"]
    )
    assert sum(line["requests_in_flight"]) * line["bin_s"] == pytest.approx(
        sum(r.e2e for r in results)
    )


def test_fixed_concurrency_counts_every_request_and_token(server_url):
    prompts = random_prompts(6, 12, 5, 4096, seed=1)
    run = run_serving(server_url, prompts, max_concurrency=2, ignore_eos=True, progress=False)
    summary = summarize_serving(run)
    _check_consistent(summary, run.results, 5)
    assert run.peak_concurrency == 2
    assert all(r.prompt_tokens == 12 for r in run.results)
    assert summary["prompt_tokens"] == 6 * 12
    assert run.model == "ssmserve-bamba-tiny"


def test_poisson_arrivals_spread_the_starts(server_url):
    prompts = random_prompts(5, 8, 3, 4096, seed=2)
    run = run_serving(server_url, prompts, request_rate=20.0, ignore_eos=True, progress=False)
    _check_consistent(summarize_serving(run), run.results, 3)
    starts = [r.start for r in run.results]
    assert starts == sorted(starts)
    # Four exponential gaps of mean 50 ms: together well above zero (all at once would
    # start every request within a few ms).
    assert starts[-1] - starts[0] > 0.02


def test_a_refused_request_is_counted_as_failed_not_dropped(server_url):
    prompts = random_prompts(2, 8, 3, 4096, seed=3)
    prompts += random_prompts(1, MAX_MODEL_LEN + 10, 3, 4096, seed=4)
    run = run_serving(server_url, prompts, ignore_eos=True, progress=False)
    summary = summarize_serving(run)
    assert summary["num_requests"] == 3 and summary["completed"] == 2
    assert summary["failed"] == 1
    assert next(iter(summary["errors"])).startswith("HTTP 400")


def test_no_server_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cannot reach a server .*`ssmserve serve"):
        served_model(f"http://127.0.0.1:{free_port()}", None)


def test_prompts_file_forms(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"def f():"\n[1, 2, 3]\n{"prompt": "x = ", "max_tokens": 2}\n')
    prompts = load_prompts(str(path), 4, 7)
    assert [p.prompt for p in prompts] == ["def f():", [1, 2, 3], "x = ", "def f():"]
    assert [p.max_tokens for p in prompts] == [7, 7, 2, 7]
    path.write_text('[{"prompt": ""}]')
    with pytest.raises(ValueError, match="item 0"):
        load_prompts(str(path), 1, 7)


def test_bench_serving_command_writes_json_and_a_plot(server_url, tmp_path, capsys):
    dataset = tmp_path / "prompts.json"
    dataset.write_text(json.dumps(["def add(a, b):", {"prompt": "import os\n", "max_tokens": 4}]))
    out_json = tmp_path / "serving.json"
    port = server_url.rsplit(":", 1)[1]
    argv = (
        f"bench serving --port {port} --num-prompts 4 --dataset-path {dataset} "
        f"--random-output-len 6 --ignore-eos --max-concurrency 3 --output-json {out_json}"
    ).split()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "requests: 100%" in captured.err
    assert "| TTFT " in captured.out and "| requests completed / sent | 4 / 4" in captured.out
    report = json.loads(out_json.read_text())
    for key in ("date", "commit", "command", "params", "results"):
        assert report[key], key
    results = report["results"]
    assert [r["output_tokens"] for r in results["per_request"]] == [6, 4, 6, 4]
    assert results["peak_concurrency"] <= 3 and results["failed"] == 0
    png = out_json.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is None:
        assert not png.exists() and "no plot: matplotlib is not installed" in captured.out
        assert main(["bench", "plot", str(out_json)]) == 2
        assert "pip install 'ssmserve[plot]'" in capsys.readouterr().err
        pytest.skip("matplotlib is not installed: the PNG part is not checked")
    assert png.read_bytes()[:8] == PNG_MAGIC
    # The same plot again, from the JSON alone.
    again = tmp_path / "again.png"
    assert main(["bench", "plot", str(out_json), "--output", str(again)]) == 0
    assert again.read_bytes()[:8] == PNG_MAGIC
