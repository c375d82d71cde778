"""benchmarks/kernels/bench_pdl.py: the engine's one-row GEMV against F.linear in
float32 and the decode chains, in the script's CPU run."""

from __future__ import annotations

import torch
from kernel_testing import run_benchmark_tiny

from ssmserve.kernels._common import HAS_GDC


def test_benchmark_tiny_smoke_run(tmp_path):
    """--tiny runs in the interpreter: the GEMV (masked and unmasked K tiles) is within
    bf16 rounding of F.linear in float32, and both chains run in every form that needs
    no GPU; on an sm_90 GPU the PDL forms too, each checked against its plain form. The
    Mamba2 chain also runs with its gated norm before out_proj, whose two launches agree
    with float32 at the chain's sizes and at its mixer-output magnitude (~1e10), and both
    chains run their two GEMVs a layer alone."""
    pdl = HAS_GDC and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    forms = ("cublas", "gemv")
    if pdl:
        forms += ("cublas+pdl", "cublas+pdl+prefetch", "gemv+pdl", "gemv+pdl+prefetch")
    results = run_benchmark_tiny("bench_pdl.py", "accuracy,chain", tmp_path)
    assert not results["errors"], results["errors"]
    assert len(results["checks"]) == (11 if pdl else 6)
    assert all(c["ok"] for c in results["checks"])
    timed = {(t["chain"], t["form"]) for t in results["timings"]}
    base = "gemv+pdl+prefetch" if pdl else "gemv"
    bare = "gemv+pdl+bare" if pdl else "gemv+bare"
    more = {("tiny-mamba2", base + "+norm"), ("tiny-mlp", bare), ("tiny-mamba2", bare)}
    assert timed == {(c, f) for c in ("tiny-mlp", "tiny-mamba2") for f in forms} | more
