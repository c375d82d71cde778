"""Prefix caching on chat-shaped traffic: TTFT, throughput and hit rates, caching on and off.

Workloads (token ids drawn from the model's vocabulary, EOS ignored):

- system-prompt: one shared system prompt (4,096 tokens) + `--questions` different
  questions (256 of 200 tokens), all arriving at `--request-rate` (default: at once).
- multi-turn: `--conversations` conversations (64) of `--turns` turns (8): each turn sends
  the conversation so far (earlier prompts and the replies) + `--turn-len` new tokens
  (300); a conversation sends its next turn when the reply to the last one is done.

    PYTHONPATH=$PWD python benchmarks/prefix_caching.py --model benchmarks/configs/bamba-9b \\
        --load-format dummy --json benchmarks/results/prefix_caching_<date>_h200_bamba9b.json
    PYTHONPATH=$PWD python benchmarks/prefix_caching.py --tiny     # CPU smoke run

Every other engine flag (--max-num-batched-tokens, --gpu-memory-utilization, ...) is
passed through; --caching picks the modes. Prints one Markdown table per workload.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ssmserve.bench.common import fmt, markdown_table, run_metadata, summarize, write_json
from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.engine.engine import LLMEngine
from ssmserve.sampling_params import SamplingParams

# The bundled model's SSD chunk is 64 tokens: the system prompt spans two.
TINY_SIZES = dict(
    system_len=140, questions=4, question_len=10, conversations=2, turns=3, turn_len=20
)


@dataclass
class Turn:
    """One request: when it may be sent, and what came back."""

    request_id: str
    prompt: list[int]
    arrival: float = 0.0  # seconds after the start of the run
    sent: float | None = None
    first_token: float | None = None
    done: float | None = None
    output: list[int] = field(default_factory=list)
    cached: int = 0


def drive(engine: LLMEngine, turns: list[Turn], params: SamplingParams, next_turn=None) -> float:
    """Send each turn at its arrival time, step until all are done (and the follow-ups
    `next_turn(finished_turn)` makes); returns the wall seconds."""
    pending = sorted(turns, key=lambda t: t.arrival)
    live: dict[str, Turn] = {}
    start = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - start
        while pending and pending[0].arrival <= now:
            turn = pending.pop(0)
            turn.sent = now
            engine.add_request(turn.request_id, {"prompt_token_ids": turn.prompt}, params)
            live[turn.request_id] = turn
        if not live:
            time.sleep(max(pending[0].arrival - now, 0.0))
            continue
        for out in engine.step():
            turn = live[out.request_id]
            t = time.perf_counter() - start
            if turn.first_token is None and out.outputs[0].token_ids:
                turn.first_token = t
            if out.finished:
                turn.done, turn.output = t, list(out.outputs[0].token_ids)
                turn.cached = out.num_cached_tokens
                del live[out.request_id]
                follow = next_turn(turn) if next_turn is not None else None
                if follow is not None:
                    follow.arrival = t
                    pending.append(follow)
                    pending.sort(key=lambda x: x.arrival)
    return time.perf_counter() - start


def system_prompt_turns(args: argparse.Namespace, vocab: int, rng: random.Random) -> list[Turn]:
    """The questions on one system prompt, arriving as a Poisson process (or at once)."""
    system = [rng.randrange(vocab) for _ in range(args.system_len)]
    turns, arrival = [], 0.0
    for i in range(args.questions):
        question = [rng.randrange(vocab) for _ in range(args.question_len)]
        turns.append(Turn(f"q{i}", system + question, arrival))
        if args.request_rate != float("inf"):
            arrival += rng.expovariate(args.request_rate)
    return turns


def run_system_prompt(engine, args, params, rng) -> tuple[list[Turn], float]:
    turns = system_prompt_turns(args, engine.model_config.vocab_size, rng)
    return turns, drive(engine, turns, params)


def run_multi_turn(engine, args, params, rng) -> tuple[list[Turn], float]:
    vocab = engine.model_config.vocab_size
    all_turns: list[Turn] = []

    def new_text() -> list[int]:
        return [rng.randrange(vocab) for _ in range(args.turn_len)]

    def next_turn(turn: Turn) -> Turn | None:
        conversation, index = turn.request_id.split("t")
        if int(index) + 1 >= args.turns:
            return None
        follow = Turn(f"{conversation}t{int(index) + 1}", turn.prompt + turn.output + new_text())
        all_turns.append(follow)
        return follow

    first = [Turn(f"c{c}t0", new_text()) for c in range(args.conversations)]
    all_turns.extend(first)
    seconds = drive(engine, first, params, next_turn)
    return all_turns, seconds


WORKLOADS = {"system-prompt": run_system_prompt, "multi-turn": run_multi_turn}


def summary_row(mode: str, turns: list[Turn], seconds: float) -> dict[str, Any]:
    prompt_tokens = sum(len(t.prompt) for t in turns)
    output_tokens = sum(len(t.output) for t in turns)
    cached = sum(t.cached for t in turns)
    return {
        "caching": mode,
        "requests": len(turns),
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "ttft_s": summarize([t.first_token - t.sent for t in turns]),
        "latency_s": summarize([t.done - t.sent for t in turns]),
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = ["caching", "requests", "seconds", "hit rate", "TTFT mean ms", "TTFT p50 ms"]
    header += ["TTFT p99 ms", "output tok/s", "total tok/s"]
    out = []
    for r in rows:
        ttft = r["ttft_s"]
        out.append(
            [
                r["caching"],
                str(r["requests"]),
                fmt(r["seconds"]),
                f"{r['hit_rate']:.1%}",
                fmt(ttft["mean"] * 1e3, 1),
                fmt(ttft["p50"] * 1e3, 1),
                fmt(ttft["p99"] * 1e3, 1),
                fmt(r["output_tokens"] / r["seconds"], 1),
                fmt((r["prompt_tokens"] + r["output_tokens"]) / r["seconds"], 1),
            ]
        )
    return markdown_table(header, out)


def warm_up(engine: LLMEngine, params: SamplingParams) -> None:
    """A few short requests so compilations and graph captures stay out of the timing;
    then the prefix cache is emptied, so every measured run starts cold."""
    for i in range(2):
        engine.add_request(f"warmup{i}", {"prompt_token_ids": [i + 1] * 32}, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint or config folder")
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--caching", choices=["on", "off", "both"], default="both")
    parser.add_argument("--system-len", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--question-len", type=int, default=200)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="questions per second"
    )
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=64, help="tokens of every reply")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: the bundled model, small sizes"
    )
    add_engine_args(parser)
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**TINY_SIZES, output_len=4, device="cpu")  # flags still win
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    modes = ["off", "on"] if args.caching == "both" else [args.caching]
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    report: dict[str, Any] = {"workloads": {w: [] for w in workloads}}
    for mode in modes:
        config = EngineConfig.from_args(args, model=args.model, enable_prefix_caching=mode == "on")
        engine = LLMEngine(config)
        report.setdefault("meta", run_metadata(os.environ.get("SSMSERVE_COMMIT"), engine.device))
        report.setdefault("model", engine.model_config.architecture)
        warm_up(engine, params)
        for workload in workloads:
            turns, seconds = WORKLOADS[workload](engine, args, params, random.Random(0))
            row = summary_row(mode, turns, seconds)
            row["stats"] = engine.stats()
            report["workloads"][workload].append(row)
            engine.reset_prefix_cache()
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["args"] = {k: v for k, v in vars(args).items() if k != "tiny"}
    for workload, rows in report["workloads"].items():
        print(f"\n## {workload} ({report['model']}, {report['meta'].get('device')})\n")
        print(table(rows))
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
