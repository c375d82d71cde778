"""Sampler timing: one call per step for B rows of a V-token vocabulary.

    python benchmarks/sampler.py [--device cuda] [--vocab 128256] [--batch-sizes 1 64 256]
                                 [--iters 20] [--json out.json]

For each batch size and workload (greedy; sampled with top-k/top-p; seeded; a mixed batch;
penalties over 1024 prompt + 512 output ids per row; greedy with 5 logprobs) it prints the
median wall time of a whole call (the host pass, the one upload, the device work and the
one copy back, which waits for the device), of the host pass alone, and on CUDA the number
of host-device synchronisations in one call (1 expected: the copy back).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from functools import partial

import torch

from ssmserve import SamplingParams
from ssmserve.bench import print_table
from ssmserve.engine.sampler import Sampler, SamplingRow, _Batch

PROMPT_LEN, OUTPUT_LEN = 1024, 512


def _rows(workload: str, batch: int, vocab: int) -> list[SamplingRow]:
    rng = random.Random(0)
    rows = []
    for i in range(batch):
        kind = workload if workload != "mixed" else ("greedy", "sampled", "seeded", "lp")[i % 4]
        params = {
            "greedy": SamplingParams(temperature=0.0),
            "sampled": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
            "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=i),
            "penalties": SamplingParams(
                temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5
            ),
            "lp": SamplingParams(temperature=0.0, logprobs=5),
        }[kind]
        prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
        output = [rng.randrange(vocab) for _ in range(OUTPUT_LEN)]
        rows.append(SamplingRow(params, 0, prompt, output))
    return rows


def _median_ms(fn, iters: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _count_syncs(fn, device: torch.device) -> int | str:
    """Host-device synchronisations in one call (CUDA only): the copy of the results back
    is one; anything more is a stall on the hot path."""
    if device.type != "cuda":
        return "-"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["greedy", "sampled", "seeded", "mixed", "penalties", "lp"],
    )
    ap.add_argument("--json", default=None, help="also write the table here")
    args = ap.parse_args()
    device = torch.device(args.device)
    sampler = Sampler()
    generator = torch.Generator(device).manual_seed(0)
    results = []
    for batch in args.batch_sizes:
        logits = torch.randn(batch, args.vocab, device=device, generator=generator) * 3
        for workload in args.workloads:
            rows = _rows(workload, batch, args.vocab)
            call_fn = partial(sampler, logits, rows, generator)
            call = _median_ms(call_fn, args.iters, device)
            host_pass = partial(_Batch, rows, args.vocab, batch, None)
            host = _median_ms(host_pass, args.iters, device)
            results.append(
                {
                    "batch": batch,
                    "vocab": args.vocab,
                    "workload": workload,
                    "call_ms": round(call, 3),
                    "host_pass_ms": round(host, 3),
                    "syncs": _count_syncs(call_fn, device),
                }
            )
    print_table(results)
    if args.json:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
