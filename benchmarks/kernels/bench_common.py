"""What the kernel benchmark scripts share: one results record per run, guarded sections,
accuracy checks, timing, the environment, and the closing table and JSON file.

Each script runs in its own process, so the module-level RESULTS is that run's record.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import triton
import triton.testing

# Ceilings measured on the H200 (docs/kernels_notes.md): device copy and bf16 matmul.
COPY_BYTES_PER_S = 4.23e12
BF16_FLOP_PER_S = 6.85e14

START = time.perf_counter()
RESULTS: dict[str, Any] = {"checks": [], "timings": [], "kernels": [], "errors": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def elapsed_s() -> float:
    return time.perf_counter() - START


def guarded(fn: Callable[[], None]) -> None:
    """Run one section; record the traceback and go on, so one failure loses no other data."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - the benchmark must go on
        tb = traceback.format_exc()
        log(f"ERROR in {fn.__name__}:\n{tb}")
        RESULTS["errors"].append({"section": fn.__name__, "traceback": tb[-3000:]})
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_sections(sections: Iterable[Callable[[], None]]) -> None:
    for section in sections:
        guarded(section)
        log(f"-- {section.__name__} done at {elapsed_s():.1f} s")


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


def graph_replay_check(
    label: str, fn: Callable[[], torch.Tensor], pool: torch.Tensor
) -> torch.cuda.CUDAGraph:
    """Capture fn (a scan call that updates the state `pool` in place) in a CUDA graph, which
    fails on any host sync, replay it from the same starting pool, record a check that y
    and the pool match the eager call's bit for bit, and return the graph for timing."""
    pool0 = pool.clone()
    y_eager = fn()
    state_eager = pool.clone()
    pool.copy_(pool0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = fn()
    pool.copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    record_check(
        label,
        {"y": rel_err(y_graph, y_eager), "state": rel_err(pool, state_eager)},
        limit=1e-6,
    )
    return graph


def module_from_source(name: str, src: str):
    """Import `src` (an edited copy of a module's source) as a fresh module named `name`,
    written to a temporary file (module.__file__), so variants compile side by side."""
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_ms(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median ms (triton.testing.do_bench) on a GPU; on CPU (the interpreter) one call's
    wall time, which only proves the path runs."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def environment(**extra: Any) -> dict[str, Any]:
    # The device machine's copy of the tree has a stale .git: pass SSMSERVE_COMMIT there.
    commit = os.environ.get("SSMSERVE_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        **extra,
    }


def finish(out_path: str, header: list[str], row: Callable[[dict[str, Any]], list[str]]) -> None:
    """Print the timings as a markdown table and the checks' summary; write the JSON."""
    RESULTS["wall_s"] = elapsed_s()
    log("\n| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for timing in RESULTS["timings"]:
        log("| " + " | ".join(row(timing)) + " |")
    fails = [c["name"] for c in RESULTS["checks"] if not c["ok"]]
    log(
        f"\nchecks: {len(RESULTS['checks']) - len(fails)} ok, failed: {fails}; "
        f"errors: {len(RESULTS['errors'])}; wall {RESULTS['wall_s']:.1f} s"
    )
    with open(out_path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    log(f"wrote {out_path}")
