"""What the benchmarks share: run metadata, percentiles, Markdown tables, JSON reports,
per-kernel profiles."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ssmserve

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99, min and max of `values`; None when there are none."""
    if not values:
        return None
    out = {"mean": sum(values) / len(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    out["min"] = min(values)
    out["max"] = max(values)
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    """A table cell: fixed decimals, thousands separators, '–' for no value."""
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown pipe table with padded columns (pastes into benchmarks/results/*.md)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "| " + " | ".join("-" * w for w in widths) + " |",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def random_token_prompts(
    num: int, length: int, vocab_size: int, rng: random.Random
) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn uniformly from the vocabulary."""
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def git_commit(env_commit: str | None) -> str:
    """The commit of the ssmserve source tree ('-dirty' with uncommitted changes to tracked
    files), or `env_commit` when given (a copy of the tree without .git)."""
    if env_commit:
        return env_commit
    root = os.path.dirname(os.path.dirname(os.path.abspath(ssmserve.__file__)))

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(
                ["git", "-C", root, *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return f"unknown (not a git checkout; ssmserve {ssmserve.__version__})"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return sha + ("-dirty" if dirty else "")


def device_name(device: Any) -> str:
    """The GPU's name, or a description of the CPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def command_line() -> str:
    """The command this process runs, as typed (`ssmserve ...` for the installed script)."""
    if os.path.basename(sys.argv[0]) == "ssmserve":
        return shlex.join(["ssmserve", *sys.argv[1:]])
    return shlex.join([os.path.basename(sys.orig_argv[0]), *sys.orig_argv[1:]])


def run_metadata(env_commit: str | None, device: Any = None) -> dict[str, Any]:
    """When and with what a result was measured (and on which `device`, when it is this
    process's), and the exact command that measured it."""
    import torch

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if device is not None:
        meta["device"] = device_name(device)
    meta.update(
        torch=torch.__version__,
        ssmserve=ssmserve.__version__,
        commit=git_commit(env_commit),
        command=command_line(),
    )
    return meta


def write_json(path: str, report: dict[str, Any]) -> None:
    """Write `report` as indented JSON, creating the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def kernel_table(
    run: Callable[[], object], iters: int, device: Any
) -> tuple[list[dict[str, Any]], float]:
    """Per kernel name, over `iters` calls of `run` under torch.profiler: launches and
    microseconds per call (device time of each kernel on CUDA, self CPU time of each op on
    the CPU), largest first; and the busy microseconds per call (the rows' sum)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(iters):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if us <= 0 or (cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        entry = totals[event.key[:80]]
        entry[0] += event.count
        entry[1] += us
    busy = sum(us for _, us in totals.values()) / iters
    rows = [
        {"kernel": name, "launches": count / iters, "us": us / iters, "share": us / iters / busy}
        for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])
    ]
    return rows, busy


def kernel_rows_table(
    rows: list[dict[str, Any]], top: int, header: Sequence[str], launch_digits: int
) -> str:
    """The first `top` rows of `kernel_table` as Markdown: name, launches, us, share."""
    body = [
        [
            r["kernel"],
            fmt(r["launches"], launch_digits),
            fmt(r["us"], 1),
            f"{100 * r['share']:.1f}%",
        ]
        for r in rows[:top]
    ]
    return markdown_table(header, body)


@contextlib.contextmanager
def recorded_launches(engine: Any) -> Iterator[list[tuple[Any, Any]]]:
    """The (packed inputs, fill tokens) of every step the engine launches inside the
    block, in order: references, to be read after whatever is being timed."""
    executor = engine.executor
    execute = executor.execute
    launched: list[tuple[Any, Any]] = []

    def recording_execute(packed, tokens=None):
        launched.append((packed, tokens))
        return execute(packed, tokens)

    executor.execute = recording_execute
    try:
        yield launched
    finally:
        del executor.execute  # the instance attribute: the class's method again
