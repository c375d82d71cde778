"""Check and time the Mamba1 selective scan (Triton) on a GPU, next to its floors.

    PYTHONPATH=$PWD python3 benchmarks/kernels/bench_selective_scan.py --out scan.json

Sections, each guarded so one failure loses no other data: (a) Triton vs the float32
PyTorch twin at real sizes (Mamba-2.8B: d_inner 5120, FalconMamba-7B: d_inner 8192;
d_state 16; one sequence and 8 varlen sequences, initial states, bf16 / fp16 / fp32,
a sequence resumed mid-block); (b) the card's exp2 rate: the scan does one exp per
token x channel x state entry, so the special-function units, not memory, set its
floor; (c) CUDA-graph capture and replay (fails on any host sync) against eager;
(d) median times (triton.testing.do_bench) at 2k / 8k / 32k tokens, one sequence and
8 sequences; (e) GPU time per launch of one call (torch.profiler); (f) a launch-config
sweep. Prints a table and writes JSON.
Floors: bytes / 4.23e12 B/s (the H200 copy rate in docs/kernels_notes.md; bytes = u,
delta, z, y, B, C once, states read and written) and exps / the rate measured in (b).
`--tiny` runs tiny shapes; without a GPU it needs TRITON_INTERPRET=1 (set if missing)
and only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", default="bench_selective_scan.json", help="path of the JSON results")
ARGS.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
OPTS = ARGS.parse_args()
if OPTS.tiny and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_common import (  # noqa: E402
    COPY_BYTES_PER_S,
    RESULTS,
    bench_ms,
    elapsed_s,
    environment,
    finish,
    graph_replay_check,
    log,
    record_check,
    rel_err,
    run_sections,
)

from ssmserve.kernels import selective_scan as scan_mod  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (name, d_inner, d_state)
MODELS = [("mamba-2.8b", 5120, 16), ("falcon-mamba-7b", 8192, 16)]
CHECK_T = 2048
TIME_T = [2048, 8192, 32768]
SWEEP_T = 8192
TIME_BUDGET_S = 80.0
SWEEP = [
    {"block_t": 8, "block_d": 32, "n_inner": 4, "num_warps": 4},
    {"block_t": 8, "block_d": 16, "n_inner": 4, "num_warps": 2},
    {"block_t": 8, "block_d": 8, "n_inner": 4, "num_warps": 1},
    {"block_t": 4, "block_d": 32, "n_inner": 4, "num_warps": 4},
    {"block_t": 16, "block_d": 32, "n_inner": 4, "num_warps": 4},
    {"block_t": 16, "block_d": 16, "n_inner": 4, "num_warps": 2},
    {"block_t": 8, "block_d": 64, "n_inner": 4, "num_warps": 4},
    {"block_t": 8, "block_d": 32, "n_inner": 2, "num_warps": 2},
    {"block_t": 8, "block_d": 32, "n_inner": 8, "num_warps": 8},
    {"block_t": 8, "block_d": 32, "n_inner": 4, "num_warps": 4, "float_bc": False},
]
if OPTS.tiny:
    MODELS = [("tiny", 16, 8), ("tiny-odd", 12, 5)]
    CHECK_T, TIME_T, SWEEP_T = 20, [12], 12
    SWEEP = SWEEP[:2] + SWEEP[-1:]


def split_evenly(T: int, S: int) -> list[int]:
    """S lengths within about 25% of T / S (deterministic), summing to T."""
    lengths = [max(1, round(T / S * (1 + ((37 * i) % 11 - 5) / 20))) for i in range(S - 1)]
    last = T - sum(lengths)
    return [*lengths, last] if last >= 1 else [T // S] * (S - 1) + [T - T // S * (S - 1)]


def make_inputs(
    lengths: list[int],
    Dm: int,
    N: int,
    init: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Fresh random inputs with Mamba1-like scales (dt 0.001..0.1, A = -(1..N) per row)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, S = sum(lengths), len(lengths)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    dt_init = torch.exp(
        torch.rand(Dm, generator=gen, device=DEV) * (math.log(0.1) - math.log(1e-3))
        + math.log(1e-3)
    )
    A_log = torch.log(torch.arange(1, N + 1, device=DEV, dtype=torch.float32)).repeat(Dm, 1)
    A_log += 0.1 * torch.randn(Dm, N, generator=gen, device=DEV)  # trained, not the init
    cu = torch.tensor([0, *lengths], device=DEV).cumsum(0).to(torch.int32)
    return dict(
        u=rand(T, Dm),
        delta=rand(T, Dm, scale=0.5),
        A=-torch.exp(A_log),
        B=rand(T, N),
        C=rand(T, N),
        D=torch.ones(Dm, device=DEV),
        z=rand(T, Dm),
        delta_bias=dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
        cu_seqlens=cu,
        # one spare slot, so a sequence never reads a slot another one writes
        ssm_state=rand(S + 1, Dm, N, scale=0.1, dtype=torch.float32),
        state_slots=torch.arange(1, S + 1, dtype=torch.int32, device=DEV),
        has_initial_state=torch.full((S,), init, dtype=torch.bool, device=DEV),
    )


def call(fn: Callable[..., torch.Tensor], inp: dict[str, Any]) -> torch.Tensor:
    return fn(
        inp["u"],
        inp["delta"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=inp["cu_seqlens"],
        ssm_state=inp["ssm_state"],
        state_slots=inp["state_slots"],
        has_initial_state=inp["has_initial_state"],
        z=inp["z"],
        delta_bias=inp["delta_bias"],
        delta_softplus=True,
    )


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def costs(T: int, S: int, Dm: int, N: int, elt: int) -> dict[str, float]:
    """Bytes moved at least once (u, delta, z read, y written, B, C, states in and out),
    exps done at least once, and the floors they give."""
    nbytes = 4 * T * Dm * elt + 2 * T * N * elt + 2 * S * Dm * N * 4 + Dm * N * 4
    exps = T * Dm * N
    exp_rate = RESULTS.get("exp2_per_s")
    mem_ms = nbytes / COPY_BYTES_PER_S * 1e3
    exp_ms = exps / exp_rate * 1e3 if exp_rate else math.nan
    return {"bytes": nbytes, "exps": exps, "floor_mem_ms": mem_ms, "floor_exp_ms": exp_ms}


def record_time(label: str, ms: float, T: int, S: int, Dm: int, N: int, elt: int, **extra):
    c = costs(T, S, Dm, N, elt)
    row = {"name": label, "ms": ms, "tokens": T, "seqs": S, **c, **extra}
    RESULTS["timings"].append(row)
    log(
        f"time {label:58s} {ms:8.3f} ms  mem floor {c['floor_mem_ms']:.3f} "
        f"({ms / c['floor_mem_ms']:.1f}x)  exp floor {c['floor_exp_ms']:.3f} "
        f"({ms / c['floor_exp_ms']:.1f}x)"
    )


def check_accuracy() -> None:
    """(a) Triton against the twin run on float32 copies of the same inputs."""
    for name, Dm, N in MODELS:
        for label, S, init, dtype in (
            ("1 seq", 1, True, torch.bfloat16),
            ("8 seqs", 8, True, torch.bfloat16),
            ("1 seq no init", 1, False, torch.bfloat16),
            ("8 seqs float32", 8, True, torch.float32),
            ("1 seq fp16", 1, True, torch.float16),
        ):
            if dtype != torch.bfloat16 and name != MODELS[0][0]:
                continue
            lengths = split_evenly(CHECK_T, S)
            inp = make_inputs(lengths, Dm, N, init, seed=S, dtype=dtype)
            floats = ("u", "delta", "B", "C", "z")
            ref_inp = {k: (v.float() if k in floats else v) for k, v in inp.items()}
            ref_inp["ssm_state"] = inp["ssm_state"].clone()
            y_ref = call(scan_mod.selective_scan_varlen_ref, ref_inp)
            y = call(scan_mod.selective_scan_varlen_triton, inp)
            sync()
            record_check(
                f"{name} T={CHECK_T} {label}",
                {"y": rel_err(y, y_ref), "state": rel_err(inp["ssm_state"], ref_inp["ssm_state"])},
            )
        # resumed mid-block equals whole, both on the kernel
        inp = make_inputs([CHECK_T], Dm, N, False, seed=9)
        y_whole = call(scan_mod.selective_scan_varlen_triton, inp)
        state_whole = inp["ssm_state"][1].clone()
        split = CHECK_T // 2 + 5
        parts = []
        for lo, hi, init in ((0, split, False), (split, CHECK_T, True)):
            part = {
                k: (v[lo:hi] if k in ("u", "delta", "B", "C", "z") else v) for k, v in inp.items()
            }
            part["cu_seqlens"] = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEV)
            part["has_initial_state"] = torch.tensor([init], device=DEV)
            parts.append(call(scan_mod.selective_scan_varlen_triton, part))
        sync()
        record_check(
            f"{name} resumed at {split} == whole",
            {
                "y": rel_err(torch.cat(parts), y_whole),
                "state": rel_err(inp["ssm_state"][1], state_whole),
            },
            limit=1e-3,
        )


def check_cuda_graph() -> None:
    """(c) Capture one call in a CUDA graph (fails on any host sync) and replay it."""
    if DEV.type != "cuda":
        log("cuda graph: no GPU, skipped")
        return
    name, Dm, N = MODELS[0]
    for S in (1, 8):
        inp = make_inputs(split_evenly(CHECK_T, S), Dm, N, True, seed=3)
        graph = graph_replay_check(
            f"{name} CUDA graph replay == eager, {S} seq(s)",
            lambda inp=inp: call(scan_mod.selective_scan_varlen_triton, inp),
            inp["ssm_state"],
        )
        record_time(
            f"{name} T={CHECK_T} {S} seq(s) graph replay",
            bench_ms(graph.replay),
            CHECK_T,
            S,
            Dm,
            N,
            2,
        )
        del graph


@triton.jit
def _exp2_rate_kernel(out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # BLOCK independent chains per program keep the special-function units busy.
    x = tl.arange(0, BLOCK).to(tl.float32) * 1e-3
    for _ in range(ITERS):
        x = tl.exp2(x * -0.75)
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), x)


def measure_exp2_rate() -> None:
    """(b) exp2 per second over the whole card (one multiply rides along each exp2)."""
    block, iters = (1024, 4096) if DEV.type == "cuda" else (16, 2)
    programs = (
        8 * torch.cuda.get_device_properties(DEV).multi_processor_count
        if (DEV.type == "cuda")
        else 2
    )
    out = torch.empty(programs * block, device=DEV)

    def run():
        _exp2_rate_kernel[(programs,)](out, ITERS=iters, BLOCK=block, num_warps=8)

    ms = bench_ms(run)
    rate = programs * block * iters / (ms * 1e-3)
    RESULTS["exp2_per_s"] = rate
    log(f"exp2 rate: {rate:.3e} /s ({ms:.3f} ms for {programs * block * iters:.2e})")


def time_sizes() -> None:
    """(d) The target sizes."""
    for name, Dm, N in MODELS:
        for T in TIME_T:
            for S in (1, 8):
                inp = make_inputs(split_evenly(T, S), Dm, N, True)
                ms = bench_ms(lambda inp=inp: call(scan_mod.selective_scan_varlen_triton, inp))
                config = scan_mod._launch_config(S, Dm, N, T, DEV)
                record_time(
                    f"{name} T={T} {S} seq(s)", ms, T, S, Dm, N, 2, model=name, config=config
                )
                del inp


def profile_kernels() -> None:
    """(e) GPU time of each launch in one call (the scan, and the B/C casts)."""
    if DEV.type != "cuda":
        log("profile: no GPU, skipped")
        return
    from torch.profiler import ProfilerActivity, profile

    name, Dm, N = MODELS[0]
    T = TIME_T[1]
    inp = make_inputs([T], Dm, N, True)
    call(scan_mod.selective_scan_varlen_triton, inp)
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call(scan_mod.selective_scan_varlen_triton, inp)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            ms = evt.time_range.elapsed_us() / 1e3 / reps
            totals[evt.name] = totals.get(evt.name, 0.0) + ms
    for kernel, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        RESULTS["kernels"].append({"kernel": kernel, "ms": ms, "case": f"{name} T={T}"})
        log(f"kernel {kernel[:60]:60s} {ms:8.3f} ms")


def sweep_configs() -> None:
    """(f) Launch configs, one sequence and 8 sequences, Mamba-2.8B dims."""
    name, Dm, N = MODELS[0]
    default = scan_mod._launch_config
    try:
        for S in (1, 8):
            inp = make_inputs(split_evenly(SWEEP_T, S), Dm, N, True)
            for override in SWEEP:
                if elapsed_s() > TIME_BUDGET_S:
                    log(f"sweep: time budget spent, skipping {override}")
                    continue
                cfg = {**default(S, Dm, N, SWEEP_T, DEV), **override}
                scan_mod._launch_config = lambda *a, cfg=cfg, **k: cfg
                try:
                    ms = bench_ms(lambda inp=inp: call(scan_mod.selective_scan_varlen_triton, inp))
                except Exception as exc:  # noqa: BLE001 - e.g. out of registers
                    log(f"sweep {cfg}: failed: {str(exc)[:300]}")
                    RESULTS["errors"].append({"section": f"sweep {cfg}", "traceback": str(exc)})
                    continue
                record_time(
                    f"sweep {name} T={SWEEP_T} {S} seq(s) " + json.dumps(override),
                    ms,
                    SWEEP_T,
                    S,
                    Dm,
                    N,
                    2,
                    config=cfg,
                )
    finally:
        scan_mod._launch_config = default


def main() -> None:
    if DEV.type != "cuda" and not OPTS.tiny:
        raise SystemExit("bench_selective_scan.py needs a CUDA GPU (or --tiny)")
    RESULTS["env"] = environment(
        **{
            "tiny": OPTS.tiny,
            "default_config_1seq_2.8b": scan_mod._launch_config(1, 5120, 16, 8192, DEV),
            "default_config_8seq_2.8b": scan_mod._launch_config(8, 5120, 16, 8192, DEV),
        }
    )
    log(json.dumps(RESULTS["env"]))
    run_sections(
        (
            check_accuracy,
            measure_exp2_rate,
            check_cuda_graph,
            time_sizes,
            profile_kernels,
            sweep_configs,
        )
    )
    finish(
        OPTS.out,
        ["case", "ms", "mem floor ms", "x mem", "exp floor ms", "x exp"],
        lambda r: [
            r["name"],
            f"{r['ms']:.3f}",
            f"{r['floor_mem_ms']:.3f}",
            f"{r['ms'] / r['floor_mem_ms']:.1f}",
            f"{r['floor_exp_ms']:.3f}",
            f"{r['ms'] / r['floor_exp_ms']:.1f}",
        ],
    )


if __name__ == "__main__":
    main()
