"""Offline throughput: `num_prompts` requests of `input_len` -> `output_len` tokens (EOS
ignored), all queued at once and served by continuous batching. Optionally the same
requests one at a time, as a baseline (slow: num_prompts times the latency of one)."""

from __future__ import annotations

import math
import random
import time
from typing import Any

from tqdm.auto import tqdm

from ssmserve.bench.common import fmt, markdown_table, random_token_prompts
from ssmserve.bench.floors import DevicePeaks, ModelCosts, floor_s
from ssmserve.sampling_params import SamplingParams

# Warm-up: this many prompts (at most) for this many tokens, so the first compilations and
# graph captures of batched prefill and decode stay out of the timing.
WARMUP_PROMPTS = 16
WARMUP_OUTPUT_LEN = 4


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=output_len, temperature=1.0, top_p=1.0, ignore_eos=True)


def _serve(engine: Any, prompts: list[list[int]], output_len: int, tag: str, bar: tqdm) -> int:
    """Queue `prompts`, step until all finish; the number of output tokens produced."""
    params = _params(output_len)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
                bar.update(1)
    return produced


def run_throughput(
    engine: Any,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    sequential_baseline: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Time continuous batching (and the one-at-a-time baseline if asked); one row per mode
    with seconds, requests, and prompt and output tokens."""
    for name, value in (
        ("num_prompts", num_prompts),
        ("input_len", input_len),
        ("output_len", output_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = random_token_prompts(num_prompts, input_len, vocab, rng)
    warmup = random_token_prompts(min(num_prompts, WARMUP_PROMPTS), input_len, vocab, rng)
    with tqdm(total=len(warmup), desc="warm-up", unit="req", disable=not progress) as bar:
        _serve(engine, warmup, min(output_len, WARMUP_OUTPUT_LEN), "warmup", bar)
    modes = ["continuous batching"] + (["one at a time"] if sequential_baseline else [])
    concurrency = {
        "continuous batching": max_concurrent(engine, num_prompts, input_len, output_len),
        "one at a time": 1,
    }
    rows = []
    for mode in modes:
        with tqdm(total=num_prompts, desc=mode, unit="req", disable=not progress) as bar:
            start = time.perf_counter()
            if mode == "continuous batching":
                produced = _serve(engine, prompts, output_len, "b", bar)
            else:
                produced = sum(
                    _serve(engine, [ids], output_len, f"s{i}-", bar)
                    for i, ids in enumerate(prompts)
                )
            seconds = time.perf_counter() - start
        rows.append(
            {
                "mode": mode,
                "requests": num_prompts,
                "concurrency": concurrency[mode],
                "seconds": seconds,
                "prompt_tokens": num_prompts * input_len,
                "output_tokens": produced,
            }
        )
    return rows


def max_concurrent(engine: Any, num_prompts: int, input_len: int, output_len: int) -> int:
    """How many of the requests can run at once: state slots / max_num_seqs, KV blocks."""
    limit = min(num_prompts, engine.scheduler.max_num_seqs)
    if engine.block_pool is not None:
        per_request = math.ceil((input_len + output_len) / engine.config.block_size)
        limit = min(limit, max(engine.block_pool.num_blocks // per_request, 1))
    return limit


def throughput_floor_s(
    costs: ModelCosts,
    peaks: DevicePeaks | None,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int,
) -> float | None:
    """The least seconds for the whole run, however the scheduler mixes prefills and
    decodes: with at most `concurrency` requests at once it takes at least
    ceil(num_prompts / concurrency) x (output_len - 1) decode steps plus one, each reading
    every weight (of a mixture of experts, those a full batch routes to); on top, every
    request's state and K/V traffic and every FLOP. Floor = max(all bytes / bandwidth,
    all FLOPs / matrix rate)."""
    if peaks is None:
        return None
    steps = math.ceil(num_prompts / concurrency) * (output_len - 1) + 1
    context = input_len + output_len / 2
    one_token = costs.weights_read_bytes(1)
    decode_bytes = costs.decode_step_bytes(1, context) - one_token
    prefill_bytes = costs.prefill_bytes(1, input_len) - costs.weights_read_bytes(input_len)
    step_weights = costs.weights_read_bytes(min(concurrency, num_prompts))
    num_bytes = steps * step_weights + num_prompts * (
        prefill_bytes + (output_len - 1) * decode_bytes
    )
    flops = num_prompts * (
        costs.prefill_flops(1, input_len) + (output_len - 1) * costs.decode_step_flops(1, context)
    )
    return floor_s(peaks, num_bytes, flops)


def add_floors(
    rows: list[dict[str, Any]],
    costs: ModelCosts,
    peaks: DevicePeaks | None,
    input_len: int,
    output_len: int,
) -> None:
    """Set each row's `floor_s`: the least time its mode could take."""
    for r in rows:
        r["floor_s"] = throughput_floor_s(
            costs,
            peaks,
            num_prompts=r["requests"],
            input_len=input_len,
            output_len=output_len,
            concurrency=r["concurrency"],
        )


def throughput_table(rows: list[dict[str, Any]]) -> str:
    """Requests/s and tokens/s per mode, beside the output tokens/s ceiling its floor allows."""
    header = [
        "mode",
        "requests",
        "at once",
        "seconds",
        "requests/s",
        "output tok/s",
        "total tok/s",
        "output tok/s ceiling",
        "of ceiling",
    ]
    out = []
    for r in rows:
        seconds = r["seconds"]
        output_rate = r["output_tokens"] / seconds
        floor = r.get("floor_s")
        ceiling = r["output_tokens"] / floor if floor else None
        out.append(
            [
                r["mode"],
                str(r["requests"]),
                str(r["concurrency"]),
                fmt(seconds),
                fmt(r["requests"] / seconds),
                fmt(output_rate, 1),
                fmt((r["prompt_tokens"] + r["output_tokens"]) / seconds, 1),
                fmt(ceiling, 1),
                f"{output_rate / ceiling:.0%}" if ceiling else "–",
            ]
        )
    return markdown_table(header, out)
