"""`ssmserve bench latency | throughput | serving`: flags (vLLM's names), tables, JSON."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from typing import Any

from ssmserve.config import EngineConfig, add_engine_args

# A copy of the source tree without .git (a GPU machine) names its commit here.
COMMIT_ENV = "SSMSERVE_COMMIT"


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` and its three kinds to an argparse subparsers object."""
    bench = subparsers.add_parser(
        "bench",
        help="latency, throughput and serving benchmarks",
        description="Benchmarks that print a table (each figure beside its floor where one "
        "can be computed) and write JSON with --output-json.",
    )
    kinds = bench.add_subparsers(dest="bench_kind", required=True, metavar="KIND")

    lat = kinds.add_parser(
        "latency",
        help="one batch: TTFT, per-token decode and end-to-end latency percentiles",
        description="Time a batch of --batch-size random prompts of --input-len tokens, "
        "each generating --output-len tokens (EOS ignored), --num-iters times after "
        "--num-iters-warmup untimed runs.",
    )
    _offline_args(lat, input_len=32, output_len=128)
    lat.add_argument("--batch-size", type=int, default=8, help="requests per batch (default 8)")
    lat.add_argument(
        "--num-iters-warmup", type=int, default=10, help="untimed iterations first (default 10)"
    )
    lat.add_argument("--num-iters", type=int, default=30, help="timed iterations (default 30)")
    lat.add_argument(
        "--peer-result",
        default=None,
        metavar="FILE",
        help="llama-bench -o json output from the same machine, shown beside the batch-1 "
        "figures (see the peers README)",
    )
    lat.set_defaults(func=run_latency_command)

    thr = kinds.add_parser(
        "throughput",
        help="offline throughput of many requests under continuous batching",
        description="Queue --num-prompts random prompts of --input-len tokens, each "
        "generating --output-len tokens (EOS ignored), and time until all finish.",
    )
    _offline_args(thr, input_len=64, output_len=64)
    thr.add_argument("--num-prompts", type=int, default=32, help="requests (default 32)")
    thr.add_argument(
        "--sequential-baseline",
        action="store_true",
        help="also time the same requests one at a time (slow: num-prompts times the "
        "latency of one request)",
    )
    thr.set_defaults(func=run_throughput_command)

    srv = kinds.add_parser(
        "serving",
        help="load generator against a running OpenAI-compatible server",
        description="Send --num-prompts streaming completion requests to a running server "
        "(start one with `ssmserve serve`), at --request-rate per second (Poisson) and/or "
        "at most --max-concurrency at once; report TTFT, TPOT, ITL and end-to-end "
        "percentiles and throughput.",
    )
    _serving_args(srv)
    srv.set_defaults(func=run_serving_command)

    plot = kinds.add_parser(
        "plot",
        help="draw the PNG of a `bench serving` JSON result (needs matplotlib)",
        description="Draw latency CDFs and throughput over time from the JSON that "
        "`bench serving --output-json` wrote, e.g. on a machine that has matplotlib when "
        "the one that ran the benchmark has not.",
    )
    plot.add_argument("result", help="JSON written by `ssmserve bench serving --output-json`")
    plot.add_argument(
        "--output", default=None, metavar="PNG", help="default: the JSON's path with .png"
    )
    plot.set_defaults(func=run_plot_command)
    return bench


def _common_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output-json", default=None, metavar="PATH", help="write the results here as JSON"
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def _offline_args(parser: argparse.ArgumentParser, *, input_len: int, output_len: int) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or cached hub id (default: the bundled model); with "
        "--load-format dummy a folder holding only config.json will do, e.g. "
        "benchmarks/configs/bamba-9b",
    )
    parser.add_argument(
        "--input-len", type=int, default=input_len, help=f"prompt tokens (default {input_len})"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=output_len,
        help=f"generated tokens per request (default {output_len})",
    )
    g = parser.add_argument_group("floors")
    g.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="TB/S",
        help="copy bandwidth (bytes read + written) for the floors (default: the measured "
        "figure of a known GPU; none on others)",
    )
    g.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="TFLOP/S",
        help="16-bit matrix-product rate for the floors (default: as --bandwidth)",
    )
    _common_output_args(parser)
    add_engine_args(parser)


def _serving_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="server port (default 8000)")
    g.add_argument(
        "--base-url", default=None, help="server URL, instead of --host/--port (http://...)"
    )
    g.add_argument(
        "--model", default=None, help="model name to request (default: the server's first)"
    )
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    g = parser.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=200, help="requests (default 200)")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default: no limit)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly max_tokens per request (the server must accept ignore_eos)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset-path",
        default=None,
        metavar="FILE",
        help="prompts: a JSON list or JSON lines of strings, token-id lists or "
        '{"prompt": ..., "max_tokens": N} (default: random token ids)',
    )
    g.add_argument(
        "--random-input-len", type=int, default=1024, help="random prompt tokens (default 1024)"
    )
    g.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="max_tokens per request (default 128; also for --dataset-path items without one)",
    )
    g.add_argument(
        "--random-vocab-size",
        type=int,
        default=4096,
        help="random prompt ids are drawn from [1, N) (default 4096, valid for any model here)",
    )
    _common_output_args(parser)
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="write a PNG (latency CDFs, throughput over time); default: beside "
        "--output-json when matplotlib is installed (pip install 'ssmserve[plot]')",
    )


# ----------------------------------------------------------------------------- runs


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _engine_and_floors(args: argparse.Namespace):
    """The engine of the run, the device's peaks (or None) and the model's costs."""
    from ssmserve.bench.common import device_name
    from ssmserve.bench.floors import device_peaks, engine_costs
    from ssmserve.engine.collector import freeze_engine_objects
    from ssmserve.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_args(args, model=args.model))
    freeze_engine_objects()  # as the server does: full collections stall the loop
    peaks = device_peaks(device_name(engine.device), args.bandwidth, args.peak_tflops)
    return engine, peaks, engine_costs(engine)


def _offline_report(kind: str, engine: Any, costs, peaks) -> dict:
    from ssmserve.bench.common import run_metadata

    config = dataclasses.asdict(engine.config)
    config.pop("extra", None)
    stats = engine.stats()
    return {
        "benchmark": kind,
        **run_metadata(os.environ.get(COMMIT_ENV), engine.device),
        "model": {
            "path": engine.model_config.path,
            "architecture": engine.model_config.architecture,
            "dtype": str(engine.dtype).replace("torch.", ""),
            "costs": costs.as_dict(),
        },
        "config": config,
        "cache": {
            "kv_blocks": stats["kv_blocks_total"],
            "state_slots": stats["state_slots_total"],
            "max_num_seqs": engine.scheduler.max_num_seqs,  # as the memory planner left it
        },
        "peaks": None if peaks is None else peaks.as_dict(),
    }


def _describe(kind: str, engine: Any, peaks, shape: str) -> str:
    from ssmserve.bench.common import device_name

    cfg = engine.config
    weights = "random weights" if cfg.load_format == "dummy" else "checkpoint weights"
    dtype = str(engine.dtype).replace("torch.", "")
    lines = [
        f"{kind}: {engine.model_config.architecture} from {engine.model_config.path} "
        f"({weights}, {dtype}) on {device_name(engine.device)}; {shape}"
    ]
    if peaks is None:
        lines.append(
            "floors: none (no measured peaks for this device; pass --bandwidth and --peak-tflops)"
        )
    else:
        lines.append(
            f"floors: {peaks.bandwidth / 1e12:g} TB/s, {peaks.flops / 1e12:g} TFLOP/s "
            f"({peaks.source})"
        )
    return "\n".join(lines)


def _finish(report: dict, table: str, header: str, path: str | None) -> int:
    from ssmserve.bench.common import write_json

    print(header)
    print(table)
    if path:
        write_json(path, report)
        print(f"wrote {path}")
    return 0


def run_latency_command(args: argparse.Namespace) -> int:
    from ssmserve.bench.latency import latency_report, load_llama_bench, run_latency

    shape = dict(batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len)
    try:
        peer = None
        if args.peer_result is not None:
            if args.batch_size != 1:
                raise ValueError(
                    "--peer-result holds llama-bench's single-stream figures; use --batch-size 1"
                )
            peer = load_llama_bench(args.peer_result, args.input_len)
        engine, peaks, costs = _engine_and_floors(args)
        samples = run_latency(
            engine,
            **shape,
            num_iters_warmup=args.num_iters_warmup,
            num_iters=args.num_iters,
            seed=args.seed,
            progress=not args.disable_tqdm,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail(exc)
    results, table = latency_report(samples, costs, peaks, peer, **shape)
    report = _offline_report("latency", engine, costs, peaks)
    report["params"] = {
        **shape,
        "num_iters_warmup": args.num_iters_warmup,
        "num_iters": args.num_iters,
    }
    report["results"] = results
    header = _describe(
        "latency",
        engine,
        peaks,
        f"batch {args.batch_size}, {args.input_len} in, {args.output_len} out; "
        f"{args.num_iters} timed iteration{'s' * (args.num_iters != 1)} after "
        f"{args.num_iters_warmup} warm-up",
    )
    return _finish(report, table, header, args.output_json)


def run_throughput_command(args: argparse.Namespace) -> int:
    from ssmserve.bench.throughput import add_floors, run_throughput, throughput_table

    try:
        engine, peaks, costs = _engine_and_floors(args)
        rows = run_throughput(
            engine,
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            sequential_baseline=args.sequential_baseline,
            seed=args.seed,
            progress=not args.disable_tqdm,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail(exc)
    add_floors(rows, costs, peaks, args.input_len, args.output_len)
    report = _offline_report("throughput", engine, costs, peaks)
    report["params"] = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "sequential_baseline": args.sequential_baseline,
    }
    report["results"] = rows
    header = _describe(
        "throughput",
        engine,
        peaks,
        f"{args.num_prompts} requests, {args.input_len} in, {args.output_len} out",
    )
    return _finish(report, throughput_table(rows), header, args.output_json)


def run_serving_command(args: argparse.Namespace) -> int:
    from ssmserve.bench.common import run_metadata
    from ssmserve.bench.plot import plot_serving
    from ssmserve.bench.serving import (
        load_prompts,
        random_prompts,
        run_serving,
        serving_table,
        summarize_serving,
    )

    has_matplotlib = _has_matplotlib()
    if args.plot and not has_matplotlib:
        return _fail(RuntimeError(NO_MATPLOTLIB))
    plot = args.plot
    if plot is None and args.output_json and has_matplotlib:
        plot = os.path.splitext(args.output_json)[0] + ".png"
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    try:
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
        if args.dataset_path:
            prompts = load_prompts(args.dataset_path, args.num_prompts, args.random_output_len)
        else:
            prompts = random_prompts(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_vocab_size,
                args.seed,
            )
        run = run_serving(
            base_url,
            prompts,
            model=args.model,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            ignore_eos=args.ignore_eos,
            api_key=args.api_key,
            seed=args.seed,
            progress=not args.disable_tqdm,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail(exc)
    summary = summarize_serving(run)
    report = {
        "benchmark": "serving",
        **run_metadata(os.environ.get(COMMIT_ENV)),
        "params": {
            "num_prompts": args.num_prompts,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,
            "max_concurrency": args.max_concurrency,
            "ignore_eos": args.ignore_eos,
            "dataset_path": args.dataset_path,
            "random_input_len": None if args.dataset_path else args.random_input_len,
            "max_tokens": args.random_output_len,
            "seed": args.seed,
        },
        "results": summary,
    }
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g}/s"
    limit = f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
    header = f"serving: {run.model} at {base_url}; {args.num_prompts} requests, {rate}{limit}"
    status = _finish(report, serving_table(summary), header, args.output_json)
    if plot:
        plot_serving(summary, plot)
        print(f"wrote {plot}")
    elif args.output_json:
        print(
            "no plot: matplotlib is not installed (pip install 'ssmserve[plot]'); "
            f"`ssmserve bench plot {args.output_json}` draws it later"
        )
    return status if not summary["failed"] else 1


def run_plot_command(args: argparse.Namespace) -> int:
    import json

    from ssmserve.bench.plot import plot_serving

    if not _has_matplotlib():
        return _fail(RuntimeError(NO_MATPLOTLIB))
    try:
        with open(args.result) as f:
            report = json.load(f)
        if report.get("benchmark") != "serving":
            raise ValueError(f"{args.result} is not a `bench serving` result")
    except (OSError, ValueError) as exc:
        return _fail(exc)
    path = args.output or os.path.splitext(args.result)[0] + ".png"
    plot_serving(report["results"], path)
    print(f"wrote {path}")
    return 0


NO_MATPLOTLIB = "plots need matplotlib: pip install 'ssmserve[plot]' (or matplotlib)"


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None
