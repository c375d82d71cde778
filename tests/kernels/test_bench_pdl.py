"""benchmarks/kernels/bench_pdl.py: its Triton GEMV (the experiment's, not yet an op of
the engine) against F.linear in float32, and the script's CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_benchmark_tiny_smoke_run(tmp_path):
    """--tiny runs in the interpreter: the GEMV (masked and unmasked K tiles) is within
    bf16 rounding of F.linear in float32, and both chains run in every form that needs
    no GPU."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "pdl.json"
    script = root / "benchmarks" / "kernels" / "bench_pdl.py"
    argv = [sys.executable, str(script), "--tiny", "--sections", "accuracy,chain"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [*argv, "--out", str(out)], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert not results["errors"], results["errors"]
    assert len(results["checks"]) == 4 and all(c["ok"] for c in results["checks"])
    timed = {(t["chain"], t["form"]) for t in results["timings"]}
    assert timed == {(c, f) for c in ("tiny-mlp", "tiny-mamba2") for f in ("cublas", "gemv")}
