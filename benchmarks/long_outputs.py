"""Long outputs: each model at the largest batch its memory holds, decode step time in the
steady state, against its byte floor; the hybrid's output tok/s over the transformer's.

A request of `--input-len` + `--output-len` tokens (1k + 8k) needs KV blocks for all of
them from the start, so a transformer's batch is capped by its KV cache while a hybrid's
state slot costs the same at any length. The batch is the largest whose state slots and
full-length KV blocks fit the cache budget the engine measures on this device. Draining
thousands of steps per model would not fit a device session, so the steady state is
timed directly: `batch` requests with prompts of `--context` tokens (standing in for
1k prompt + (context - 1k) generated: the same KV and state per step) are prefilled, and
then `--window` decode steps are timed once every request decodes.

    PYTHONPATH=$PWD python benchmarks/long_outputs.py --load-format dummy \\
        --models benchmarks/configs/bamba-9b benchmarks/configs/llama-3-8b \\
        --state-dtypes float32 bfloat16 --json benchmarks/results/long_outputs_<date>_h200.json

The first model is compared with the last (`<first>_over_<last>_output_tok_s`, per state
dtype). Engine flags other than these are passed through (--gpu-memory-utilization, ...).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import time
from typing import Any

import torch

from ssmserve.bench.common import device_name, fmt, markdown_table, run_metadata, write_json
from ssmserve.bench.floors import device_peaks, engine_costs, floor_s, meta_model, model_costs
from ssmserve.config import EngineConfig, ModelConfig, add_engine_args
from ssmserve.engine.collector import freeze_engine_objects
from ssmserve.engine.engine import LLMEngine
from ssmserve.sampling_params import RequestOutputKind, SamplingParams


def cache_budget(args: argparse.Namespace, model: str) -> tuple[int, torch.dtype, bool]:
    """Bytes the engine gives its caches on this device for `model` (what the weights and
    the activation peak leave: the same whatever the state dtype), the weights' dtype,
    and whether the model has SSM layers (state slots)."""
    probe = LLMEngine(
        EngineConfig.from_args(args, **_engine_args(args, model, 1), enforce_eager=True)
    )
    budget = probe.cache_budget_bytes
    dtype, has_state = probe.dtype, probe.state_pool is not None
    probe.shutdown()
    del probe
    _free_memory()
    return int(budget), dtype, has_state


def largest_batch(
    model: str, dtype: torch.dtype, state_dtype: str, budget: int, args: argparse.Namespace
) -> int:
    """Requests of input_len + output_len tokens whose state slots and KV blocks fit."""
    model_config = ModelConfig.from_hf(model)
    states = dtype if state_dtype == "auto" else getattr(torch, state_dtype)
    block = args.block_size
    costs = model_costs(
        meta_model(model_config, dtype), model_config.hf_config, dtype, states, block
    )
    blocks = math.ceil((args.input_len + args.output_len) / block)
    per_request = costs.state_bytes_per_seq + blocks * costs.kv_bytes_per_token * block
    return max(budget // per_request, 1)


def _engine_args(args: argparse.Namespace, model: str, max_num_seqs: int) -> dict[str, Any]:
    return dict(
        model=model,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
    )


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


class _Pauses:
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.started = 0.0

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self.started)


def _full_collections() -> _Pauses:
    """Full collections of Python's cyclic collector from now on (each stops the step
    loop while it walks every tracked object): their count and time, for the report."""
    pauses = _Pauses()
    gc.callbacks.append(pauses.callback)
    return pauses


def steady_decode(
    engine: LLMEngine, batch: int, context: int, window: int, max_tokens: int, rng: random.Random
) -> dict[str, Any]:
    """Prefill `batch` prompts of `context` tokens, then time `window` decode steps (the
    requests allowed `max_tokens` each: none ends before the last one is prefilled)."""
    vocab = engine.model_config.hf_config.vocab_size
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i in range(batch):
        prompt = [rng.randrange(1, vocab) for _ in range(context)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    scheduler = engine.scheduler
    start = time.perf_counter()
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()
    for _ in range(4):  # the first decode steps: graphs warm, the pipeline full
        engine.step()
    _sync(engine)
    prefill_s = time.perf_counter() - start
    running = len(scheduler.running)
    pauses = _full_collections()
    start = time.perf_counter()
    for _ in range(window):
        engine.step()
    _sync(engine)
    step_s = (time.perf_counter() - start) / window
    gc.callbacks.remove(pauses.callback)
    for request_id in [str(i) for i in range(batch)]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "running": running,
        "prefill_s": prefill_s,
        "step_s": step_s,
        "full_gc_collections": len(pauses.seconds),
        "full_gc_s": sum(pauses.seconds),
    }


def measure(
    args: argparse.Namespace, model: str, state_dtype: str, budget: int, dtype: torch.dtype
) -> dict[str, Any]:
    batch = min(largest_batch(model, dtype, state_dtype, budget, args), args.max_batch)
    engine = LLMEngine(
        EngineConfig.from_args(
            args,
            **_engine_args(args, model, batch),
            mamba_ssm_cache_dtype=state_dtype,
            cache_memory=budget,
        )
    )
    freeze_engine_objects()  # as the server does; engine.shutdown() thaws
    batch = min(batch, engine.scheduler.max_num_seqs)
    remaining = args.input_len + args.output_len - args.context
    result = steady_decode(engine, batch, args.context, args.window, remaining, random.Random(0))
    costs = engine_costs(engine)
    peaks = device_peaks(device_name(engine.device))
    floor = floor_s(
        peaks,
        costs.decode_step_bytes(batch, args.context),
        costs.decode_step_flops(batch, args.context),
    )
    engine.shutdown()
    del engine
    _free_memory()
    step = result["step_s"]
    return {
        "model": os.path.basename(model.rstrip("/")),
        "state_dtype": state_dtype,
        "batch": batch,
        "running": result["running"],
        "context": args.context,
        "cache_budget_gib": budget / 2**30,
        "step_ms": step * 1e3,
        "floor_step_ms": floor * 1e3 if floor is not None else None,
        "over_floor": step / floor if floor else None,
        "output_tok_s": result["running"] / step,
        "prefill_s": result["prefill_s"],
        "full_gc_collections": result["full_gc_collections"],
        "full_gc_s": result["full_gc_s"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = ["model", "state", "batch", "step ms", "floor ms", "x floor", "output tok/s"]
    body = [
        [
            r["model"],
            r["state_dtype"],
            str(r["running"]),
            fmt(r["step_ms"]),
            fmt(r["floor_step_ms"]),
            fmt(r["over_floor"]),
            fmt(r["output_tok_s"], 0),
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="model paths or names")
    parser.add_argument(
        "--state-dtypes",
        nargs="+",
        default=["float32"],
        help="SSM state dtypes to run the models with SSM layers at (default float32)",
    )
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=8192)
    parser.add_argument(
        "--context", type=int, default=5120, help="tokens per request when timed (default 5120)"
    )
    parser.add_argument("--window", type=int, default=32, help="decode steps timed (32)")
    parser.add_argument("--max-batch", type=int, default=1024, help="cap on the batch (1024)")
    parser.add_argument("--json", default=None, help="write the report here")
    add_engine_args(parser)  # --max-num-seqs and --max-model-len are set per model
    args = parser.parse_args(argv)
    if not args.input_len <= args.context <= args.input_len + args.output_len - args.window - 8:
        parser.error(
            "--context must lie between --input-len and --input-len + --output-len minus "
            "the window (and a few steps to fill the pipeline)"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rows = []
    for model in args.models:
        budget, dtype, has_state = cache_budget(args, model)
        for state_dtype in args.state_dtypes if has_state else ["auto"]:
            rows.append(measure(args, model, state_dtype, budget, dtype))
            print(table(rows[-1:]), flush=True)
    report: dict[str, Any] = {
        "meta": run_metadata(
            os.environ.get("SSMSERVE_COMMIT"), "cuda" if torch.cuda.is_available() else "cpu"
        )
    }
    report["shape"] = {
        k: getattr(args, k) for k in ("input_len", "output_len", "context", "window")
    }
    report["rows"] = rows
    first, last = rows[0]["model"], rows[-1]["model"]
    if first != last:
        base = next(r for r in rows if r["model"] == last)
        for r in rows:
            if r["model"] == first:
                key = f"{first}_over_{last}_output_tok_s_{r['state_dtype']}"
                report[key] = r["output_tok_s"] / base["output_tok_s"]
    print(table(rows))
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
