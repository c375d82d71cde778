"""What the kernel benchmarks share: options, guarded sections, accuracy checks, timing,
the run's environment, and the closing table, JSON and Markdown files.

Each script runs in its own process, so the module-level RESULTS is that run's record.
Run them from the repository root with PYTHONPATH=$PWD. `--tiny` runs tiny shapes; without
a GPU it runs them in Triton's CPU interpreter, which only checks that the script runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ssmserve.bench.cli import COMMIT_ENV
from ssmserve.bench.common import git_commit

# Ceilings measured by bench_ceilings.py: device copy (bytes read + written) and bf16
# matrix product, per GPU (benchmarks/results/README.md; the H100 SXM's:
# ceilings_2026-12-06_h100.json). Floors are max(bytes / COPY, FLOP / BF16) unless a
# script says otherwise. Other devices (and the interpreter) take the H200's; the run's
# environment records which were used.
CEILINGS = {"H200": (4.23e12, 6.85e14), "H100 80GB HBM3": (3.02e12, 6.91e14)}
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_NAME = torch.cuda.get_device_name() if DEV.type == "cuda" else ""
COPY_BYTES_PER_S, BF16_FLOP_PER_S = next(
    (c for key, c in CEILINGS.items() if key in _NAME), CEILINGS["H200"]
)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results")
START = time.perf_counter()
RESULTS: dict[str, Any] = {"checks": [], "timings": [], "kernels": [], "errors": []}


def parse_args(doc: str, sections: Sequence[str], extra: Callable | None = None):
    """The options every script takes; `extra(parser)` adds a script's own.

    --tiny without a GPU switches on Triton's interpreter (with the test harness's
    interpreter workarounds), so call this before any kernel runs.
    """
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: interpreter)")
    parser.add_argument(
        "--sections", default=",".join(sections), help=f"comma-separated subset of {sections}"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="JSON results path (default: benchmarks/results/<op>_<date>_<gpu>.json; "
        "with --tiny a temporary folder); the Markdown goes beside it",
    )
    parser.add_argument(
        "--commit", default=None, help="commit measured (default: $SSMSERVE_COMMIT, else git HEAD)"
    )
    if extra is not None:
        extra(parser)
    opts = parser.parse_args()
    unknown = set(opts.sections.split(",")) - set(sections)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(sections)}")
    if DEV.type != "cuda":
        if not opts.tiny:
            raise SystemExit("no CUDA GPU: add --tiny for a CPU check of the script")
        try:
            from tests.triton_interpreter import patch_interpreter
        except ImportError as exc:
            raise SystemExit("run from the repository root with PYTHONPATH=$PWD") from exc
        patch_interpreter()
        os.environ["TRITON_INTERPRET"] = "1"
    return opts


def kernel_ops():
    """The op set a server gets on this device: kernel_backend "auto" on a GPU (hopper on
    sm_90, triton elsewhere), "triton" in the interpreter."""
    from ssmserve.kernels import get_ops

    return get_ops("auto" if DEV.type == "cuda" else "triton", DEV)


def log(msg: str) -> None:
    print(msg, flush=True)


def elapsed_s() -> float:
    return time.perf_counter() - START


def run_sections(opts: argparse.Namespace, named: dict[str, Callable[[], None]]) -> None:
    """Run the chosen sections in order; a failure is recorded and the next one runs."""
    for name in opts.sections.split(","):
        try:
            named[name]()
        except Exception:  # noqa: BLE001 - one failure must not lose the other sections
            tb = traceback.format_exc()
            log(f"ERROR in {name}:\n{tb}")
            RESULTS["errors"].append({"section": name, "traceback": tb[-3000:]})
        finally:
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
        log(f"-- {name} done at {elapsed_s():.1f} s")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error (inf if `out` has non-finite values)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def record_check(name: str, errors: dict[str, float], limit: float = 1e-2) -> None:
    ok = all(e <= limit for e in errors.values())
    RESULTS["checks"].append({"name": name, "rel_err": errors, "limit": limit, "ok": ok})
    pretty = ", ".join(f"{k}={v:.2e}" for k, v in errors.items())
    log(f"check {'OK  ' if ok else 'FAIL'} {name}: {pretty} (limit {limit:.0e})")


def floor_ms(nbytes: float, flops: float = 0.0) -> float:
    return max(nbytes / COPY_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e3


def record_time(name: str, ms: float, floor: float, **extra: Any) -> None:
    """One timing row: measured ms next to its floor (ms)."""
    RESULTS["timings"].append({"name": name, "ms": ms, "floor_ms": floor, **extra})
    log(f"time {name:60s} {ms:9.4f} ms  floor {floor:.4f}  ({ms / floor:.2f}x)")


def bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median ms (triton.testing.do_bench) on a GPU; in the interpreter one call's wall
    time, which only proves the path runs."""
    if DEV.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn captured in a CUDA graph (capture fails on any host sync), after a warm-up call
    on a side stream; returns the graph and the outputs it writes on replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_replay_check(
    label: str, fn: Callable[[], torch.Tensor], pool: torch.Tensor
) -> torch.cuda.CUDAGraph:
    """Capture fn (a call that updates the state `pool` in place), replay it from the same
    starting pool, record that y and the pool match the eager call's bit for bit, and
    return the graph for timing."""
    pool0 = pool.clone()
    y_eager = fn()
    state_eager = pool.clone()
    pool.copy_(pool0)
    graph, y_graph = capture(fn)
    pool.copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    errors = {"y": rel_err(y_graph, y_eager), "state": rel_err(pool, state_eager)}
    record_check(label, errors, limit=0.0)
    return graph


def profile_ms(fn: Callable[[], Any], case: str, reps: int = 5) -> None:
    """GPU time per kernel of one call (torch.profiler), recorded under "kernels"."""
    if DEV.type != "cuda":
        log("profile: no GPU, skipped")
        return
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = evt.name[:80]
            totals[name] = totals.get(name, 0.0) + evt.time_range.elapsed_us() / 1e3 / reps
    for kernel, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        RESULTS["kernels"].append({"kernel": kernel, "ms": ms, "case": case})
        log(f"kernel {kernel:70s} {ms:8.4f} ms")


def _commit(opts: argparse.Namespace) -> str:
    """--commit, else $SSMSERVE_COMMIT (a copy of the tree whose .git is stale or absent,
    as on the device), else git HEAD."""
    return opts.commit or git_commit(os.environ.get(COMMIT_ENV))


def environment(opts: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """Date, GPU, versions, commit and exact command of this run (also logged)."""
    import triton

    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(opts),
        "command": " ".join(["python", *sys.argv]),
        "tiny": opts.tiny,
        "ceilings": {"copy_bytes_per_s": COPY_BYTES_PER_S, "bf16_flop_per_s": BF16_FLOP_PER_S},
        **extra,
    }
    RESULTS["env"] = env
    log(json.dumps(env, default=str))
    return env


def _out_path(opts: argparse.Namespace, op: str) -> str:
    if opts.out:
        return opts.out
    gpu = RESULTS["env"]["gpu"]
    slug = re.sub(r"[^a-z0-9]", "", gpu.lower().split()[-1]) if DEV.type == "cuda" else "cpu"
    folder = tempfile.mkdtemp() if opts.tiny else RESULTS_DIR
    stem = os.path.join(folder, f"{op}_{RESULTS['env']['date'][:10]}")
    for suffix in ["", *"bcdefghijklmnopqrstuvwxyz"]:
        path = f"{stem}{suffix}_{slug}.json"
        if not os.path.exists(path):
            return path
    raise SystemExit(f"too many results files named {stem}*_{slug}.json; pass --out")


def finish(opts: argparse.Namespace, op: str, title: str) -> None:
    """Print and write the run: JSON (everything) and Markdown (environment, checks, times
    next to floors) at the same path stem."""
    RESULTS["wall_s"] = elapsed_s()
    env = RESULTS["env"]
    lines = [f"# {title}", ""]
    lines += [f"- {k}: `{v}`" for k, v in env.items() if k != "ceilings"]
    lines += ["", "| check | rel. L2 error | limit | ok |", "| --- | --- | --- | --- |"]
    for c in RESULTS["checks"]:
        errors = ", ".join(f"{k} {v:.1e}" for k, v in c["rel_err"].items())
        lines.append(
            f"| {c['name']} | {errors} | {c['limit']:.0e} | {'yes' if c['ok'] else 'NO'} |"
        )
    lines += ["", "| case | ms | floor ms | x floor |", "| --- | --- | --- | --- |"]
    for t in RESULTS["timings"]:
        ratio = t["ms"] / t["floor_ms"] if t["floor_ms"] else math.nan
        lines.append(f"| {t['name']} | {t['ms']:.4f} | {t['floor_ms']:.4f} | {ratio:.2f} |")
    if RESULTS["kernels"]:
        lines += ["", "| kernel (GPU time per call) | case | ms |", "| --- | --- | --- |"]
        lines += [f"| {k['kernel']} | {k['case']} | {k['ms']:.4f} |" for k in RESULTS["kernels"]]
    fails = [c["name"] for c in RESULTS["checks"] if not c["ok"]]
    lines += [
        "",
        f"Checks: {len(RESULTS['checks']) - len(fails)} ok, failed: {fails or 'none'}; "
        f"errors: {[e['section'] for e in RESULTS['errors']] or 'none'}; "
        f"wall {RESULTS['wall_s']:.1f} s.",
    ]
    text = "\n".join(lines) + "\n"
    log("\n" + text)
    path = _out_path(opts, op)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text)
    log(f"wrote {path} and its .md")
