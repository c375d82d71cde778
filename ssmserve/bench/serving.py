"""Load generator against a running OpenAI-compatible server (`ssmserve serve`, vLLM, ...).

Requests go to /v1/completions with streaming on, so each response's chunks time the
first token (TTFT) and the gaps between tokens (ITL); the usage chunk the server sends at
the end (`stream_options.include_usage`) counts prompt and output tokens. Requests arrive
as a Poisson process at `request_rate` per second (all at once when it is infinite), with
at most `max_concurrency` in flight when that is set.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm

from ssmserve.bench.common import (
    fmt,
    markdown_table,
    percentile,
    random_token_prompts,
    summarize,
)


@dataclass(frozen=True)
class ServingPrompt:
    """One request to send: text or token ids, and how many tokens to ask for."""

    prompt: str | list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """What one request measured, in seconds from the start of the run."""

    start: float
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class ServingRun:
    """Every request's result, the run's wall time and the most requests in flight."""

    model: str
    base_url: str
    results: list[RequestResult]
    duration: float
    peak_concurrency: int


def random_prompts(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[ServingPrompt]:
    """Token-id prompts of exactly `input_len` tokens (no tokenizer needed on this side).

    Ids come from [1, vocab_size); 4096 (the default) is the smallest vocabulary of the
    bundled models, so they are valid ids of any model."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be at least 1")
    rng = random.Random(seed)
    ids = random_token_prompts(num_prompts, input_len, vocab_size - 1, rng)
    return [ServingPrompt([t + 1 for t in p], output_len) for p in ids]


def load_prompts(path: str, num_prompts: int, output_len: int) -> list[ServingPrompt]:
    """Prompts from a file: a JSON list, or JSON lines; each item a prompt string, a list
    of token ids, or an object {"prompt": ..., "max_tokens": N (optional)}. The first
    `num_prompts` are used, cycling when the file holds fewer."""
    with open(path) as f:
        text = f.read()
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            items = [items]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is neither JSON nor JSON lines: {exc}") from None
    prompts = []
    for i, item in enumerate(items):
        max_tokens = output_len
        if isinstance(item, dict):
            max_tokens = item.get("max_tokens", output_len)
            item = item.get("prompt")
        ok_ids = isinstance(item, list) and item and all(isinstance(t, int) for t in item)
        if not (isinstance(item, str) and item) and not ok_ids:
            raise ValueError(
                f"{path}, item {i}: a prompt is a non-empty string, a list of token ids or "
                '{"prompt": ..., "max_tokens": N}'
            )
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}, item {i}: max_tokens must be a positive integer")
        prompts.append(ServingPrompt(item, max_tokens))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


async def _one_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    t0: float,
) -> RequestResult:
    result = RequestResult(start=time.perf_counter() - t0)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter() - t0
                if chunk.get("choices"):
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = usage.get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter() - t0
    if result.error is None and result.ttft is None:
        result.error = "the stream ended without a token"
    if result.error is None and result.output_tokens is None:
        result.output_tokens = len(result.chunk_times)  # a server that sends no usage
    return result


async def _run(
    base_url: str,
    model: str,
    prompts: list[ServingPrompt],
    request_rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    api_key: str | None,
    seed: int,
    progress: bool,
) -> tuple[list[RequestResult], float, int]:
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    in_flight = peak = 0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    # No read timeout: a long generation streams for as long as it streams.
    timeout = httpx.Timeout(None, connect=30.0)
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not progress)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()

        async def send(prompt: ServingPrompt) -> RequestResult:
            nonlocal in_flight, peak
            body = {
                "model": model,
                "prompt": prompt.prompt,
                "max_tokens": prompt.max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": ignore_eos,
            }
            async with limit:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await _one_request(client, url, body, t0)
                finally:
                    in_flight -= 1
                    bar.update(1)

        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration, peak


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models; a clear error when it is not up."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise RuntimeError(
            f"cannot reach a server at {base_url} ({exc}); start one first, e.g. "
            "`ssmserve serve MODEL --port 8000`, or pass --base-url"
        ) from None
    if response.status_code != 200:
        raise RuntimeError(
            f"{base_url}/v1/models answered {response.status_code}: {response.text[:200]}"
        )
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model NAME")
    return models[0]["id"]


def run_serving(
    base_url: str,
    prompts: list[ServingPrompt],
    *,
    model: str | None = None,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> ServingRun:
    """Send every prompt (to `model`, default the server's first) and time each one."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (inf = all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    model = model or served_model(base_url, api_key)
    results, duration, peak = asyncio.run(
        _run(
            base_url,
            model,
            prompts,
            request_rate,
            max_concurrency,
            ignore_eos,
            api_key,
            seed,
            progress,
        )
    )
    return ServingRun(model, base_url, results, duration, peak)


def itl_cdf(results: list[RequestResult]) -> list[float]:
    """Inter-token latencies at the 0th, 1st, ..., 100th percentile: their CDF, compactly."""
    gaps = sorted(gap for r in results for gap in r.itl)
    return [percentile(gaps, q) for q in range(101)] if gaps else []


def timeline(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Output tokens/s and mean requests in flight over time, in bins of `bin_s` seconds
    (a chunk carries its share of its request's output tokens)."""
    bins = max(min(120, math.ceil(duration / 0.25)), 1)
    width = duration / bins
    tokens = [0.0] * bins
    busy = [0.0] * bins
    for r in results:
        share = r.output_tokens / max(len(r.chunk_times), 1)
        for t in r.chunk_times:
            tokens[min(int(t / width), bins - 1)] += share
        for b in range(min(int(r.start / width), bins - 1), min(int(r.end / width), bins - 1) + 1):
            overlap = min(r.end, (b + 1) * width) - max(r.start, b * width)
            busy[b] += max(overlap, 0.0) / width
    return {
        "bin_s": width,
        "output_tokens_per_s": [n / width for n in tokens],
        "requests_in_flight": busy,
    }


def summarize_serving(run: ServingRun) -> dict[str, Any]:
    """Counts, throughput, latency percentiles (seconds) and per-request records (JSON)."""
    results, duration = run.results, run.duration
    ok = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "model": run.model,
        "base_url": run.base_url,
        "num_requests": len(results),
        "peak_concurrency": run.peak_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_s": summarize([r.ttft for r in ok]),
        "tpot_s": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": summarize([gap for r in ok for gap in r.itl]),
        "e2e_s": summarize([r.e2e for r in ok]),
        "itl_cdf_s": itl_cdf(ok),
        "timeline": timeline(ok, duration),
        "per_request": [
            {
                "start": r.start,
                "ttft": r.ttft,
                "e2e": r.e2e,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "chunks": len(r.chunk_times),
                "error": r.error,
            }
            for r in results
        ],
    }


def serving_table(report: dict[str, Any]) -> str:
    """Latency percentiles (ms), then counts and throughput."""
    rows = []
    for key, label in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT (per output token after the first)"),
        ("itl_s", "ITL (between chunks)"),
        ("e2e_s", "end to end"),
    ):
        stats = report[key]
        if stats is not None:
            rows.append([label] + [fmt(1e3 * stats[k]) for k in ("mean", "p50", "p90", "p99")])
    latency = markdown_table(["latency (ms)", "mean", "p50", "p90", "p99"], rows)
    totals = markdown_table(
        ["measure", "value"],
        [
            ["requests completed / sent", f"{report['completed']} / {report['num_requests']}"],
            ["duration (s)", fmt(report["duration_s"])],
            ["most requests in flight", str(report["peak_concurrency"])],
            ["requests/s", fmt(report["request_throughput"])],
            ["output tok/s", fmt(report["output_throughput"], 1)],
            ["total tok/s", fmt(report["total_token_throughput"], 1)],
        ],
    )
    return latency + "\n\n" + totals
