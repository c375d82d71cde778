"""Offline throughput: continuous batching against one request at a time.

    python benchmarks/throughput.py [--model M] [--num-prompts 32] [--input-len 64]
                                    [--output-len 64] [--device cpu]

Prints a table and writes JSON + Markdown under benchmarks/results/ with the date,
machine, commit and exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from ssmserve.bench import print_table, run_throughput
from ssmserve.config import EngineConfig, add_engine_args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--tag", default="cpu")
    add_engine_args(ap)
    args = ap.parse_args()
    config = EngineConfig.from_args(args, model=args.model)
    rows = run_throughput(config, args.num_prompts, args.input_len, args.output_len)
    print_table(rows)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    machine = (
        torch.cuda.get_device_name()
        if config.device != "cpu" and torch.cuda.is_available()
        else f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}"
    )
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "commit": commit,
        "command": "python " + " ".join(sys.argv),
        "model": args.model or "bundled ssmserve-bamba-tiny",
        "rows": rows,
    }
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    stem = os.path.join(out_dir, f"throughput_{args.tag}_{report['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# Offline throughput ({args.tag})\n\n")
        for key in ("date", "machine", "commit", "command", "model"):
            f.write(f"- {key}: `{report[key]}`\n")
        f.write("\n| mode | output tok/s | total tok/s | seconds |\n| --- | --- | --- | --- |\n")
        for r in rows:
            f.write(
                f"| {r['mode']} | {r['output_tokens_per_s']} | {r['total_tokens_per_s']} "
                f"| {r['seconds']} |\n"
            )
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
