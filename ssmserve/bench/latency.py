"""Latency of one batch: time to first token (the prefill), per-token decode, end to end.

Each iteration adds `batch_size` fresh random prompts of `input_len` tokens (fresh, so a
prefix cache cannot shorten a prefill), each asking for `output_len` tokens with EOS
ignored, and steps the engine until they finish. TTFT is the time until every request of
the batch has its first token; decode is the rest divided by the `output_len - 1` steps.
The median of the `engine.step()` calls after the first token is also kept: the steady
step, without what the window's two ends add.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from ssmserve.bench.common import fmt, markdown_table, percentile, random_token_prompts, summarize
from ssmserve.bench.floors import DevicePeaks, ModelCosts, floor_s
from ssmserve.sampling_params import SamplingParams


@dataclass
class LatencySample:
    """One iteration, in seconds."""

    ttft: float
    decode_per_token: float | None  # None when output_len is 1
    e2e: float
    decode_step_p50: float | None = None  # the median step() call after the first token


def time_batch(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> LatencySample:
    """Run `prompts` together to `output_len` tokens each; time the first token and the rest."""
    # vLLM's latency benchmark samples at temperature 1 with EOS ignored; so does this one.
    params = SamplingParams(max_tokens=output_len, temperature=1.0, top_p=1.0, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    lengths: dict[str, int] = {}
    first = None
    calls: list[float] = []  # each step() call's seconds after the first token
    while engine.has_unfinished_requests():
        call = time.perf_counter()
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
        if first is not None:
            calls.append(time.perf_counter() - call)
        if first is None and len(started) == len(prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    short = {rid: n for rid, n in lengths.items() if n != output_len}
    if short or len(lengths) != len(prompts):
        raise RuntimeError(
            f"requests ended with other than {output_len} tokens ({short}); the timing "
            "would not be of the asked shape"
        )
    decode = (end - first) / (output_len - 1) if output_len > 1 else None
    step = percentile(calls, 50) if calls else None
    return LatencySample(first - start, decode, end - start, step)


def run_latency(
    engine: Any,
    *,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters_warmup: int,
    num_iters: int,
    seed: int = 0,
    progress: bool = True,
) -> list[LatencySample]:
    """Warm up, then time `num_iters` batches; a tqdm bar over each phase."""
    for name, value in (
        ("batch_size", batch_size),
        ("input_len", input_len),
        ("output_len", output_len),
        ("num_iters", num_iters),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be 0 or more, got {num_iters_warmup}")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    samples = []
    phases = (("warm-up", num_iters_warmup, False), ("latency", num_iters, True))
    for desc, count, keep in phases:
        for it in tqdm(range(count), desc=desc, unit="batch", disable=not progress or not count):
            prompts = random_token_prompts(batch_size, input_len, vocab, rng)
            sample = time_batch(engine, prompts, output_len, f"{desc}{it}")
            if keep:
                samples.append(sample)
    return samples


@dataclass(frozen=True)
class PeerFigures:
    """A peer engine's batch-1 figures (llama.cpp's llama-bench), in seconds."""

    prefill: list[float]  # per run, for `prefill_tokens` tokens from an empty context
    prefill_tokens: int
    decode_per_token: list[float]  # per run, `decode_tokens` generated after `decode_depth`
    decode_tokens: int
    decode_depth: int
    source: dict[str, Any]


def load_llama_bench(path: str, input_len: int) -> PeerFigures:
    """Read `llama-bench -o json` (or `-o jsonl`) output: the prefill test closest to
    `input_len` tokens and the generation test at the depth closest to `input_len`."""
    with open(path) as f:
        text = f.read()
    try:
        tests = json.loads(text)
    except json.JSONDecodeError:
        try:
            tests = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
    required = ("n_prompt", "n_gen", "samples_ns")
    if (
        not isinstance(tests, list)
        or not tests
        or not all(isinstance(t, dict) and all(k in t for k in required) for t in tests)
    ):
        raise ValueError(
            f"{path} is not llama-bench output: expected a list of tests with "
            f"{', '.join(required)} (run llama-bench with -o json)"
        )
    prefills = [t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0]
    prefills = [t for t in prefills if t.get("n_depth", 0) == 0] or prefills
    decodes = [t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0]
    if not prefills or not decodes:
        raise ValueError(
            f"{path} needs a prefill test (-p N) and a generation test (-n N) from llama-bench"
        )
    pp = min(prefills, key=lambda t: abs(t["n_prompt"] - input_len))
    tg = min(decodes, key=lambda t: abs(t.get("n_depth", 0) - input_len))
    keys = ("build_commit", "gpu_info", "backends", "model_filename", "model_type", "flash_attn")
    return PeerFigures(
        prefill=[ns / 1e9 for ns in pp["samples_ns"]],
        prefill_tokens=pp["n_prompt"],
        decode_per_token=[ns / 1e9 / tg["n_gen"] for ns in tg["samples_ns"]],
        decode_tokens=tg["n_gen"],
        decode_depth=tg.get("n_depth", 0),
        source={"engine": "llama.cpp", "file": path, **{k: pp[k] for k in keys if k in pp}},
    )


def latency_floors(
    costs: ModelCosts, peaks: DevicePeaks | None, batch_size: int, input_len: int, output_len: int
) -> dict[str, float | None]:
    """Floors of the figures: the prefill of the batch, a decode step at the mean context
    of the timed steps (also the median step call's), and the two together (seconds)."""
    prefill = floor_s(
        peaks,
        costs.prefill_bytes(batch_size, input_len),
        costs.prefill_flops(batch_size, input_len),
    )
    context = input_len + output_len / 2
    decode = floor_s(
        peaks,
        costs.decode_step_bytes(batch_size, context),
        costs.decode_step_flops(batch_size, context),
    )
    e2e = None if prefill is None else prefill + (output_len - 1) * decode
    decode = decode if output_len > 1 else None
    return {"ttft": prefill, "decode_per_token": decode, "e2e": e2e, "decode_step_p50": decode}


def latency_summary(samples: list[LatencySample]) -> dict[str, dict[str, float] | None]:
    return {
        "ttft": summarize([s.ttft for s in samples]),
        "decode_per_token": summarize(
            [s.decode_per_token for s in samples if s.decode_per_token is not None]
        ),
        "e2e": summarize([s.e2e for s in samples]),
        "decode_step_p50": summarize(
            [s.decode_step_p50 for s in samples if s.decode_step_p50 is not None]
        ),
    }


def latency_table(
    summary: dict[str, dict[str, float] | None],
    floors: dict[str, float | None],
    peer: PeerFigures | None,
) -> str:
    """Each figure (ms) with its floor and how far above it the median is."""
    header = ["measure (ms)", "mean", "p50", "p90", "p99", "floor", "p50 / floor"]
    rows = []
    names = {
        "ttft": "TTFT (prefill + first token)",
        "decode_per_token": "decode step (a token per request)",
        "e2e": "end to end",
        "decode_step_p50": "median step() call after the first token",
    }
    for key, label in names.items():
        stats = summary[key]
        if stats is None:
            continue
        floor = floors.get(key)
        ratio = f"{stats['p50'] / floor:.2f}x" if floor else "–"
        cells = [fmt(1e3 * stats[k]) for k in ("mean", "p50", "p90", "p99")]
        rows.append([label, *cells, fmt(None if floor is None else 1e3 * floor), ratio])
    if peer is not None:
        for label, values in (
            (f"llama.cpp prefill {peer.prefill_tokens}", peer.prefill),
            (
                f"llama.cpp decode, per token (tg{peer.decode_tokens} @ {peer.decode_depth})",
                peer.decode_per_token,
            ),
        ):
            mean = sum(values) / len(values)
            cells = [fmt(1e3 * mean)] + [fmt(1e3 * percentile(values, q)) for q in (50, 90, 99)]
            rows.append([label, *cells, "", ""])
    return markdown_table(header, rows)


def latency_report(
    samples: list[LatencySample],
    costs: ModelCosts,
    peaks: DevicePeaks | None,
    peer: PeerFigures | None,
    **shape: int,
) -> tuple[dict[str, Any], str]:
    """The JSON results and the printed table of one latency run."""
    summary = latency_summary(samples)
    floors = latency_floors(
        costs, peaks, shape["batch_size"], shape["input_len"], shape["output_len"]
    )
    results = {
        "summary_s": summary,
        "floors_s": floors,
        "samples_s": [asdict(s) for s in samples],
        "peer": None if peer is None else asdict(peer),
    }
    return results, latency_table(summary, floors, peer)
