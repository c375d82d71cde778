"""One decode step at any batch and context, timed and broken down by kernel, in seconds.

A decode step's cost depends on the batch, the context each request has (the K/V it
reads) and the state each carries, not on what the tokens are. So instead of prefilling
`--batch-size` prompts of `--context` tokens (minutes at 484 x 5k on an H200), this builds
the step directly: every request gets a state slot and the KV blocks of `--context`
tokens from the engine's own pools (whatever they hold: random weights make every value
equally meaningless), and the step is the packed decode the engine would launch
(`StepInputs`, one token per request at position `--context`). It is run through the
engine's model runner as the engine runs it (a CUDA graph where one is captured), timed
over `--iters` runs, and with `--profile` broken down per kernel (torch.profiler, over
`--profile-iters` runs), next to the step's floor (bytes it must move over the device's
copy bandwidth, or FLOPs over its matrix rate, whichever is larger).

    PYTHONPATH=$PWD python benchmarks/decode_profile.py --model benchmarks/configs/bamba-9b \\
        --load-format dummy --batch-size 484 --context 5120 --profile \\
        --json benchmarks/results/decode_profile_<date>_h200_bamba9b_b484_5k.json

It measures the forward (and the LM head) only, no host work between steps; with
`--sample greedy` or `--sample temperature` each step also launches the engine's sampler
on its logits (every row greedy, or drawn at temperature 1 from a generator, as
`bench latency` asks: no wait for the results), so the step is the device's whole token.
The engine's own step at the same shape is what benchmarks/long_outputs.py times.
`--attention-decode-config` and `--gemv-config` set launch parameters of the Triton decode
attention and of the one-row GEMV for the run (`decode_launch_config`'s and
`gemv_launch_config`'s keys, over their defaults). `--variants` times several such sets in
one process instead, each with its own CUDA graphs, taking turns over `--rounds` rounds of
`--iters` steps (one model load, and drift between processes or over time falls on all of
them alike):

    --variants '[{}, {"gemv": {"num_warps": 8}}, {"attention": {"num_splits": 32}}]'
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from ssmserve.bench.common import kernel_rows_table, kernel_table, run_metadata, write_json
from ssmserve.bench.floors import device_peaks, engine_costs, floor_s
from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.engine.cuda_graphs import DecodeGraphs
from ssmserve.engine.engine import LLMEngine
from ssmserve.engine.sampler import Sampler, SamplingRow
from ssmserve.kernels import gemv, paged_attention
from ssmserve.layers.batch import ForwardBatch, StepInputs
from ssmserve.sampling_params import SamplingParams


def decode_step(engine: LLMEngine, batch: int, context: int) -> torch.Tensor:
    """The packed decode step of `batch` requests at `context` tokens each, with slots and
    blocks taken from the engine's pools (never given back: the engine is for this only)."""
    block_size = engine.config.block_size
    inputs = StepInputs(logits_indices=list(range(batch)), num_decodes=batch)
    for i in range(batch):
        blocks: list[int] = []
        if engine.block_pool is not None:
            blocks = engine.block_pool.allocate(engine.block_pool.blocks_for(context + 1))
            if blocks is None:
                raise SystemExit(
                    f"the KV cache holds fewer than {batch} requests of {context + 1} tokens "
                    f"(ran out at request {i}); lower --batch-size or --context"
                )
        slot = engine.state_pool.allocate() if engine.state_pool is not None else None
        inputs.add_sequence([1 + i % 100], context, blocks, block_size, slot)
    return inputs.pack()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the bundled one)")
    parser.add_argument("--batch-size", type=int, default=1, help="requests in the step (1)")
    parser.add_argument("--context", type=int, default=2048, help="tokens each has (2048)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps (20)")
    parser.add_argument("--profile", action="store_true", help="per-kernel breakdown")
    parser.add_argument("--profile-iters", type=int, default=5, help="profiled steps (5)")
    parser.add_argument("--top", type=int, default=20, help="kernels listed (20)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument(
        "--attention-decode-config",
        type=json.loads,
        default={},
        help="decode attention launch parameters, JSON (e.g. '{\"mask_skip\": false}')",
    )
    parser.add_argument(
        "--gemv-config",
        type=json.loads,
        default={},
        help="one-row GEMV launch parameters, JSON (e.g. '{\"num_warps\": 8}')",
    )
    parser.add_argument(
        "--variants",
        type=json.loads,
        default=None,
        help="launch parameter sets to time in turn, a JSON list of objects with keys "
        "'gemv' and 'attention' (e.g. '[{}, {\"gemv\": {\"num_warps\": 8}}]')",
    )
    parser.add_argument("--rounds", type=int, default=3, help="turns of each variant (3)")
    parser.add_argument(
        "--sample",
        choices=("none", "greedy", "temperature"),
        default="none",
        help="launch the sampler on each step's logits: every row greedy, or drawn at "
        "temperature 1 (default none: the forward alone)",
    )
    add_engine_args(parser)  # --max-num-seqs and --max-model-len follow the shape
    args = parser.parse_args(argv)
    if min(args.batch_size, args.context, args.iters, args.profile_iters, args.rounds) < 1:
        parser.error(
            "--batch-size, --context, --iters, --profile-iters and --rounds must be positive"
        )
    if args.tensor_parallel_size * args.pipeline_parallel_size != 1:
        parser.error("decode_profile.py runs one device (tensor and pipeline size 1)")
    if args.variants is None:
        args.variants = [{"gemv": args.gemv_config, "attention": args.attention_decode_config}]
    elif args.gemv_config or args.attention_decode_config:
        parser.error("--variants replaces --gemv-config and --attention-decode-config")
    if not isinstance(args.variants, list) or not args.variants:
        parser.error("--variants: a non-empty JSON list of objects")
    for i, variant in enumerate(args.variants):
        if not isinstance(variant, dict) or set(variant) - {"gemv", "attention"}:
            parser.error(f"--variants[{i}]: an object with keys 'gemv' and 'attention' only")
        variant.setdefault("gemv", {})
        variant.setdefault("attention", {})
        try:  # unknown keys and bad values, before the model loads
            paged_attention.decode_launch_config(
                1, 1, 1, 16, 64, torch.device("cpu"), variant["attention"]
            )
        except (ValueError, TypeError) as exc:
            parser.error(f"attention decode config {variant['attention']}: {exc}")
        try:
            gemv.gemv_launch_config(1, 16, torch.device("cpu"), variant["gemv"])
        except (ValueError, TypeError) as exc:
            parser.error(f"GEMV config {variant['gemv']}: {exc}")
    return args


@contextlib.contextmanager
def launch_overrides(module: Any, name: str, overrides: dict[str, Any]):
    """Within: the launch parameters `module.name` (a `*_launch_config` function taking
    `config`) returns are `overrides` over its defaults (a call's own config still wins)."""
    default = getattr(module, name)
    signature = inspect.signature(default)

    def with_overrides(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["config"] = {**overrides, **(bound.arguments.get("config") or {})}
        return default(*bound.args, **bound.kwargs)

    setattr(module, name, with_overrides)
    try:
        yield
    finally:
        setattr(module, name, default)


def decode_attention_overrides(overrides: dict[str, Any]):
    """`launch_overrides` of the decode attention."""
    return launch_overrides(paged_attention, "decode_launch_config", overrides)


@contextlib.contextmanager
def variant_overrides(variant: dict[str, dict[str, Any]]):
    """The launch parameters of one `--variants` entry, over the defaults."""
    with (
        decode_attention_overrides(variant["attention"]),
        launch_overrides(gemv, "gemv_launch_config", variant["gemv"]),
    ):
        yield


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return profile(parse_args(argv))


def profile(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig.from_args(
        args,
        max_num_seqs=args.batch_size,
        max_model_len=args.context + 1,
        enable_prefix_caching=False,
    )
    with variant_overrides(args.variants[0]):  # the engine's own graphs are the first's
        engine = LLMEngine(config)
    runner, device = engine.executor.runner, engine.device
    packed = decode_step(engine, args.batch_size, args.context)

    sampler = Sampler()
    params = SamplingParams(temperature=0.0 if args.sample == "greedy" else 1.0)
    rows = [SamplingRow(params, 0, [], []) for _ in range(args.batch_size)]
    generator = torch.Generator(device).manual_seed(0)

    def run() -> None:
        logits = runner.execute(packed)
        if args.sample != "none":
            sampler.launch(logits, rows, generator)

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(args.iters):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / args.iters

    # Each further variant's graphs are captured under its launch parameters (a graph
    # keeps the launches it was captured with; each set holds its own memory pool); eager
    # steps read them at each launch, so every run of a variant is inside its overrides.
    engine_graphs = runner.graphs
    graphs = []
    for i, variant in enumerate(args.variants):
        with variant_overrides(variant):
            if engine_graphs is not None and i > 0:
                runner.graphs = DecodeGraphs(
                    runner, engine_graphs.sizes[-1], engine_graphs.max_blocks
                )
                runner.graphs.capture()
            graphs.append(runner.graphs)
            for _ in range(3):
                run()
    times: list[list[float]] = [[] for _ in args.variants]
    for _ in range(args.rounds):
        for variant, variant_graphs, variant_times in zip(args.variants, graphs, times):
            runner.graphs = variant_graphs
            with variant_overrides(variant):
                variant_times.append(timed())
    runner.graphs = graphs[0]
    step_s = statistics.median(times[0])
    costs = engine_costs(engine)
    peaks = device_peaks(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    step_bytes = costs.decode_step_bytes(args.batch_size, args.context)
    step_flops = costs.decode_step_flops(args.batch_size, args.context)
    floor = floor_s(peaks, step_bytes, step_flops)
    report: dict[str, Any] = {
        "meta": run_metadata(os.environ.get("SSMSERVE_COMMIT"), device),
        "model": engine.model_name,
        "batch_size": args.batch_size,
        "context": args.context,
        "state_dtype": config.mamba_ssm_cache_dtype,
        "sample": args.sample,
        "graph": runner.graphs is not None
        and runner.graphs.can_run(ForwardBatch.from_packed(packed, device)),
        "step_ms": 1e3 * step_s,
        "floor_ms": None if floor is None else 1e3 * floor,
        "bytes": step_bytes,
        "flops": step_flops,
        "attention_decode_config": args.variants[0]["attention"],
        "gemv_config": args.variants[0]["gemv"],
        "rounds": args.rounds,
        "variants": [
            {**variant, "step_ms": 1e3 * statistics.median(t), "rounds_ms": [1e3 * x for x in t]}
            for variant, t in zip(args.variants, times)
        ],
    }
    for variant in report["variants"]:
        print(
            f"{engine.model_name}: batch {args.batch_size} at {args.context} tokens, "
            f"{'graph replay' if report['graph'] else 'eager'}: {variant['step_ms']:.3f} ms/step"
            + (
                ""
                if floor is None
                else f", floor {1e3 * floor:.3f} ms ({variant['step_ms'] / (1e3 * floor):.2f}x)"
            )
            + f" (median of {args.rounds}; gemv {variant['gemv']}, attention "
            f"{variant['attention']})"
        )
    if args.profile:  # the first variant's
        with variant_overrides(args.variants[0]):
            rows, busy = kernel_table(run, args.profile_iters, device)
        report["kernels"] = rows
        report["busy_us"] = busy
        what = "kernels" if device.type == "cuda" else "ops"
        print(f"busy {busy / 1e3:.3f} ms/step in {sum(r['launches'] for r in rows):.0f} {what}")
        print(kernel_rows_table(rows, args.top, ["kernel", "per step", "us/step", "share"], 1))
    if args.json:
        write_json(args.json, report)
    engine.shutdown()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
