"""What an engine step at N running requests costs beyond its forward, in milliseconds.

`--num-requests` requests of `--input-len` random prompt tokens, each asking for
`--output-len` tokens (temperature 1, EOS ignored), are added at once, and the engine is
stepped until they finish, each `engine.step()` timed. The steady steps are those in
which every request advanced by one token; the first `--skip-first` and the last
`--skip-last` of them are dropped, and the median of the rest is the step time. With
overlap_steps (the default) a call returns the outputs of the step the call before
launched, and launches the next step itself: in the middle of the steady steps, every
call launches a decode of all N requests.

The forward is that of one such step, in the middle of the steady ones: its packed inputs
(and the sampled ids of the step before that its input tokens are filled from), caught
as the engine launches it, run again through the engine's model runner `--forward-iters`
times after generation, back to back as the engine runs its steps (a CUDA graph replay
where the engine replays one; CUDA events between them), median. Step minus forward is
what a step costs beyond its forward: on a GPU, what the device waits for the host
between steps and the sampling; on the CPU, where everything runs synchronously, the
step's host work (planning, packing, sampling, detokenizing, the outputs).

    PYTHONPATH=$PWD python benchmarks/step_overhead.py --model benchmarks/configs/bamba-9b \\
        --load-format dummy --num-requests 256 --input-len 1024 --output-len 160 \\
        --json benchmarks/results/step_overhead_<date>_h200_bamba9b_256.json

The tokens a step advanced are the engine's generated-token count (`stats()`) after the
call minus before. `--output-kind` is what each request asks its outputs as: cumulative
(SamplingParams' default) and delta detokenize every request at every step, final_only
(as `LLM.generate` asks) once, at its end; on the CPU that is most of the overhead at a
few hundred requests.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from ssmserve.bench.common import (
    fmt,
    markdown_table,
    percentile,
    random_token_prompts,
    recorded_launches,
    run_metadata,
    write_json,
)
from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.engine.collector import freeze_engine_objects
from ssmserve.engine.engine import LLMEngine
from ssmserve.layers.batch import ForwardBatch
from ssmserve.sampling_params import RequestOutputKind, SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(
    engine: LLMEngine, progress: bool
) -> tuple[list[float], list[int], dict[int, tuple[torch.Tensor, torch.Tensor | None]]]:
    """Step the engine until its requests finish. Per `engine.step()` call: its seconds,
    the tokens it generated, and the packed inputs (and fill tokens) of the step it
    launched, by call index."""
    launched: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    seconds: list[float] = []
    tokens: list[int] = []
    with (
        recorded_launches(engine) as launches,
        tqdm(desc="steps", unit="step", disable=not progress) as bar,
    ):
        generated = engine.stats()["generation_tokens_total"]
        while engine.has_unfinished_requests():
            before_launches = len(launches)
            start = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - start)
            before, generated = generated, engine.stats()["generation_tokens_total"]
            tokens.append(generated - before)
            if len(launches) > before_launches:
                launched[len(seconds) - 1] = launches[before_launches]
            bar.update()
    return seconds, tokens, launched


def forward_seconds(
    engine: LLMEngine, packed: torch.Tensor, fill_tokens: torch.Tensor | None, iters: int
) -> list[float]:
    """Seconds of each of `iters` runs of one packed step through the model runner, back
    to back (on a GPU, timed by events between them: a forward started from an idle,
    synchronised GPU takes longer at small batches)."""
    runner, device = engine.executor.runner, engine.device
    if device.type != "cuda":
        seconds = []
        for _ in range(iters):
            start = time.perf_counter()
            runner.execute(packed, tokens=fill_tokens)
            seconds.append(time.perf_counter() - start)
        return seconds
    runner.execute(packed, tokens=fill_tokens)  # a first run, not timed
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for event in events[1:]:
        runner.execute(packed, tokens=fill_tokens)
        event.record()
    _sync(device)
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:], strict=False)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the bundled one)")
    parser.add_argument("--num-requests", type=int, default=256, help="requests (256)")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens (1024)")
    parser.add_argument("--output-len", type=int, default=160, help="output tokens (160)")
    parser.add_argument(
        "--skip-first", type=int, default=20, help="steady steps dropped at the start (20)"
    )
    parser.add_argument(
        "--skip-last", type=int, default=5, help="steady steps dropped at the end (5)"
    )
    parser.add_argument("--forward-iters", type=int, default=10, help="forward replays (10)")
    parser.add_argument(
        "--output-kind",
        default="cumulative",
        choices=[kind.name.lower() for kind in RequestOutputKind],
        help="what each request's outputs carry (cumulative: SamplingParams' default)",
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--json", default=None, help="write the report here")
    add_engine_args(parser)  # --max-num-seqs is --num-requests
    args = parser.parse_args(argv)
    if min(args.num_requests, args.input_len, args.output_len, args.forward_iters) < 1:
        parser.error(
            "--num-requests, --input-len, --output-len and --forward-iters must be positive"
        )
    if min(args.skip_first, args.skip_last) < 0:
        parser.error("--skip-first and --skip-last must be 0 or more")
    if args.output_len <= args.skip_first + args.skip_last:
        parser.error(
            f"at most --output-len ({args.output_len}) steps advance every request, and "
            f"--skip-first + --skip-last ({args.skip_first + args.skip_last}) of them are "
            "dropped; raise --output-len or skip fewer"
        )
    total = args.input_len + args.output_len
    if args.max_model_len is not None and args.max_model_len < total:
        parser.error(f"--max-model-len must be at least --input-len + --output-len ({total})")
    if args.tensor_parallel_size * args.pipeline_parallel_size != 1:
        parser.error("step_overhead.py runs one device (tensor and pipeline size 1)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    num_requests = args.num_requests
    config = EngineConfig.from_args(
        args,
        max_num_seqs=num_requests,
        max_model_len=args.max_model_len or args.input_len + args.output_len,
    )
    engine = LLMEngine(config)
    if engine.scheduler.max_num_seqs < num_requests:
        raise SystemExit(
            f"the cache holds {engine.scheduler.max_num_seqs} requests at once, not "
            f"{num_requests}; lower --num-requests or give the cache more memory "
            "(--gpu-memory-utilization, --cache-memory)"
        )
    freeze_engine_objects()  # as the server does: full collections stall the loop
    vocab = engine.model_config.vocab_size
    prompts = random_token_prompts(num_requests, args.input_len, vocab, random.Random(args.seed))
    params = SamplingParams(
        max_tokens=args.output_len,
        temperature=1.0,
        ignore_eos=True,
        output_kind=RequestOutputKind[args.output_kind.upper()],
    )
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    seconds, tokens, launched = timed_steps(engine, not args.disable_tqdm)
    steady = [i for i, n in enumerate(tokens) if n == num_requests]
    used = steady[args.skip_first : len(steady) - args.skip_last]
    if not used:
        raise SystemExit(
            f"{len(steady)} steps advanced all {num_requests} requests, and "
            f"{args.skip_first} + {args.skip_last} are skipped: none left to time "
            f"({engine.stats()['num_preemptions']} preemptions); raise --output-len"
        )
    # The step the middle steady call launched: a decode of every request.
    packed, fill_tokens = launched[used[len(used) // 2]]
    cpu_batch = ForwardBatch.from_packed(packed, torch.device("cpu"))
    if not cpu_batch.num_decodes == cpu_batch.input_ids.numel() == num_requests:
        raise RuntimeError(
            f"the step launched in the middle of the steady ones decodes "
            f"{cpu_batch.num_decodes} of {cpu_batch.input_ids.numel()} tokens, not one for "
            f"each of the {num_requests} requests; this is a bug in step_overhead.py"
        )
    forward = forward_seconds(engine, packed, fill_tokens, args.forward_iters)
    runner, device = engine.executor.runner, engine.device
    used_ms = [1e3 * seconds[i] for i in used]
    step_ms = percentile(used_ms, 50)
    forward_ms = 1e3 * percentile(forward, 50)
    report: dict[str, Any] = {
        "meta": run_metadata(os.environ.get("SSMSERVE_COMMIT"), device),
        "model": engine.model_name,
        "num_requests": num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "output_kind": args.output_kind,
        "prefix_caching": config.enable_prefix_caching,
        "overlap_steps": config.overlap_steps,
        "step_calls": len(seconds),
        "steady_steps": len(steady),
        "steady_steps_used": len(used),
        "preemptions": engine.stats()["num_preemptions"],
        "forward_batch": cpu_batch.num_decodes,
        "graph": runner.graphs is not None
        and runner.graphs.can_run(ForwardBatch.from_packed(packed, device)),
        "step_ms": step_ms,
        "step_ms_mean": sum(used_ms) / len(used_ms),
        "steps_ms": used_ms,  # each steady step used, in order (spikes a median hides)
        "forward_ms": forward_ms,
        "overhead_ms": step_ms - forward_ms,
    }
    print(
        f"{engine.model_name}: {num_requests} running, engine step {step_ms:.2f} ms minus "
        f"its forward {forward_ms:.2f} ms ({'graph replay' if report['graph'] else 'eager'}) "
        f"= {report['overhead_ms']:.2f} ms (medians of {len(used)} steady steps and "
        f"{args.forward_iters} forwards; mean step {report['step_ms_mean']:.3f} ms)"
    )
    header = ["running", "step ms", "forward ms", "step - forward ms", "steady steps used"]
    row = [str(num_requests), fmt(step_ms), fmt(forward_ms), fmt(report["overhead_ms"])]
    print(markdown_table(header, [[*row, str(len(used))]]))
    if args.json:
        write_json(args.json, report)
    engine.shutdown()
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
