"""A/B timing of SSD scan versions: each one checked against the first, then timed.

    PYTHONPATH=$PWD python3 benchmarks/kernels/ssd_ab.py FILE[:JSON] [FILE[:JSON] ...]

FILE is a version of ssmserve/kernels/ssd_scan.py (for example the committed one with a
patch from benchmarks/kernels/experiments/ applied); JSON overrides its _launch_config.
Bamba-9B mixer dims, one sequence with an initial state, 32k and 4k tokens; the relative
L2 error of y and of the final state is against the first spec's; a torch.profiler pass
gives each launch's share at 32k. Needs a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

# These variants are of the Triton-language kernel, which an H100/H200 otherwise skips
# for bf16 inputs (ssd_scan_hopper.py takes those calls).
os.environ.setdefault("SSMSERVE_SSD_GLUON", "0")
sys.path.insert(0, os.path.dirname(__file__))
import bench_ssd as bs  # noqa: E402
from bench_common import bench_ms, rel_err  # noqa: E402


def load(path: str, index: int):
    spec = importlib.util.spec_from_file_location(f"ssd_ab_{index}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernel_ms(fn, reps: int = 5) -> dict[str, float]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and "_ssd_" in evt.name:
            totals[evt.name] = totals.get(evt.name, 0.0) + evt.device_time / 1e3 / reps
    return totals


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ssd_ab.py needs a CUDA GPU")
    _, H, P, N, G = bs.MODELS[0]
    inp = bs.make_inputs([32768], H, P, N, G, True)
    inp4k = bs.make_inputs([4096], H, P, N, G, True)
    pool = inp["ssm_state"].clone()  # the timed calls update inp's pool in place
    y_ref = state_ref = None
    for i, spec in enumerate(sys.argv[1:]):
        path, _, override = spec.partition(":")
        try:
            mod = load(path, i)
            if override:
                base, extra = mod._launch_config, json.loads(override)
                mod._launch_config = lambda *a, base=base, extra=extra: {**base(*a), **extra}
            state = pool.clone()
            y = bs.call(mod.ssd_scan_varlen_triton, {**inp, "ssm_state": state})
            if y_ref is None:
                y_ref, state_ref = y, state
            ms = bench_ms(lambda mod=mod: bs.call(mod.ssd_scan_varlen_triton, inp))
            ms4k = bench_ms(lambda mod=mod: bs.call(mod.ssd_scan_varlen_triton, inp4k))
            print(
                f"{spec:70s} 32k {ms:.3f} ms  4k {ms4k:.3f} ms  err y "
                f"{rel_err(y, y_ref):.1e} state {rel_err(state, state_ref):.1e}",
                flush=True,
            )
            shares = kernel_ms(lambda mod=mod: bs.call(mod.ssd_scan_varlen_triton, inp))
            print("    " + "  ".join(f"{k}={v:.3f}" for k, v in shares.items()), flush=True)
        except Exception as exc:  # noqa: BLE001 - a version may not compile
            print(f"{spec} FAILED: {str(exc)[:400]}", flush=True)


if __name__ == "__main__":
    main()
