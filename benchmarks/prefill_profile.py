"""Where one prompt's prefill time goes: its time to first token against the time the
device is busy, by kernel.

An engine is built from the engine flags. `--warmup` prompts of `--input-len` random
tokens run first (compiles, graph captures, the allocator's pools); then `--iters` more
are timed, each from `add_request` until `engine.step()` returns its first token (the
TTFT is their median: it moves by several ms between runs), and one more runs under
torch.profiler for the busy time: on CUDA the device time of its
kernels, on the CPU the self time of its ops. Every prompt is new and the prefix cache
is emptied before each, so no prefill is shortened by a hit. The host share is
1 - busy / TTFT: on CUDA the part of the wall time the device waits for the host; on the
CPU the Python between the ops.

The steps the timed prompt took are reported with the tokens of each: with prefix caching
on, a model with SSM layers stops a prompt's prefill one token short of its end (so the
state a repeat of the prompt resumes from is kept) and computes the last token in a step
of its own. The floor is the prefill's bytes over the device's copy bandwidth or its
FLOPs over its matrix rate, whichever is larger (as `ssmserve bench latency`'s TTFT floor).

    PYTHONPATH=$PWD python benchmarks/prefill_profile.py --model benchmarks/configs/mamba2-2.7b \\
        --load-format dummy --input-len 2048 \\
        --json benchmarks/results/prefill_profile_<date>_h200_mamba2_2.7b_2k.json

and again with --no-enable-prefix-caching.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

from ssmserve.bench.common import (
    device_name,
    kernel_rows_table,
    kernel_table,
    percentile,
    random_token_prompts,
    recorded_launches,
    run_metadata,
    write_json,
)
from ssmserve.bench.floors import device_peaks, engine_costs
from ssmserve.bench.latency import latency_floors
from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.engine.collector import freeze_engine_objects
from ssmserve.engine.engine import LLMEngine
from ssmserve.sampling_params import SamplingParams


def first_token(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Run one prompt to its first token: the seconds from `add_request` until a step
    returns it, and the tokens of each step launched meanwhile."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=1.0, ignore_eos=True)
    with recorded_launches(engine) as launched:
        start = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, [int(packed[0]) for packed, _ in launched]  # the header's token count


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the bundled one)")
    parser.add_argument("--input-len", type=int, default=2048, help="prompt tokens (2048)")
    parser.add_argument("--warmup", type=int, default=3, help="prompts run first (3)")
    parser.add_argument("--iters", type=int, default=5, help="timed prompts, median (5)")
    parser.add_argument("--top", type=int, default=20, help="kernels listed (20)")
    parser.add_argument("--json", default=None, help="write the report here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.input_len < 1 or args.top < 1 or args.iters < 1:
        parser.error("--input-len, --top and --iters must be positive")
    if args.max_model_len is not None and args.max_model_len <= args.input_len:
        parser.error("--max-model-len must exceed --input-len (a token is generated)")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    if args.tensor_parallel_size * args.pipeline_parallel_size != 1:
        parser.error("prefill_profile.py runs one device (tensor and pipeline size 1)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = EngineConfig.from_args(args, max_model_len=args.max_model_len or args.input_len + 1)
    engine = LLMEngine(config)
    freeze_engine_objects()  # as the server does: full collections stall the loop
    device = engine.device
    vocab = engine.model_config.vocab_size
    prompts = iter(
        random_token_prompts(
            args.warmup + args.iters + 1, args.input_len, vocab, random.Random(args.seed)
        )
    )
    for i in range(args.warmup):
        first_token(engine, f"warmup-{i}", next(prompts))
    timed = [first_token(engine, f"timed-{i}", next(prompts)) for i in range(args.iters)]
    samples = [seconds for seconds, _ in timed]
    ttft_s, step_tokens = percentile(samples, 50), timed[0][1]
    rows, busy_us = kernel_table(lambda: first_token(engine, "profiled", next(prompts)), 1, device)
    busy_s = 1e-6 * busy_us
    peaks = device_peaks(device_name(device))
    floor = latency_floors(engine_costs(engine), peaks, 1, args.input_len, 1)["ttft"]
    report: dict[str, Any] = {
        "meta": run_metadata(os.environ.get("SSMSERVE_COMMIT"), device),
        "model": engine.model_name,
        "input_len": args.input_len,
        "prefix_caching": config.enable_prefix_caching,
        "ttft_ms": 1e3 * ttft_s,
        "ttft_samples_ms": [1e3 * seconds for seconds in samples],
        "busy_ms": 1e3 * busy_s,
        "kernels": round(sum(r["launches"] for r in rows)),
        "host_share": 1 - busy_s / ttft_s,
        "steps": len(step_tokens),
        "step_tokens": step_tokens,
        "floor_ms": None if floor is None else 1e3 * floor,
        "kernel_rows": rows,
    }
    what = "kernels" if device.type == "cuda" else "ops"
    print(
        f"{engine.model_name}: a {args.input_len}-token prompt, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}: TTFT {1e3 * ttft_s:.2f} ms in "
        f"{len(step_tokens)} step{'s' * (len(step_tokens) > 1)} {step_tokens}, "
        f"busy {1e3 * busy_s:.2f} ms in "
        f"{report['kernels']} {what} (host {100 * report['host_share']:.0f}%)"
        + ("" if floor is None else f", floor {1e3 * floor:.2f} ms ({ttft_s / floor:.2f}x)")
    )
    print(kernel_rows_table(rows, args.top, [what[:-1], "launches", "us", "share of busy"], 0))
    if args.json:
        write_json(args.json, report)
    engine.shutdown()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
