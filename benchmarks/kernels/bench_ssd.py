"""Check and time the chunk-parallel SSD varlen scan on a GPU, next to its floor.

    PYTHONPATH=$PWD python3 benchmarks/kernels/bench_ssd.py --out ssd.json

Sections, each guarded so one failure loses no other data: (a) Triton vs the float32
PyTorch twin at real sizes (4k tokens, one sequence and 8 varlen sequences, initial
states); (b) CUDA-graph capture and replay (proves no host sync) against eager;
(c) median times (triton.testing.do_bench) at 4k / 32k / 128k tokens and 8 x 4k varlen,
for Bamba-9B and Mamba2-2.7B mixer dims; (c'') the Gluon kernel against the
Triton-language one under graph replay, 1k to 32k tokens (section "compare"); (d)
per-kernel split of one 32k call (torch.profiler); (e) a launch-config sweep at 32k
(of the Triton-language kernel: run it with SSMSERVE_SSD_GLUON=0 on an H100/H200).
Prints a table and writes JSON.
Floors are max(bytes / 4.23e12, FLOP / 6.85e14) (the H200 copy and bf16 matmul rates
measured in docs/kernels_notes.md); "design MB" adds the scratch traffic of the
chunk-parallel design (contributions, entering states) to the essential bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import triton
from bench_common import (
    BF16_FLOP_PER_S,
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

from ssmserve.kernels import ssd_scan as ssd_mod

# (name, heads, head_dim, d_state, n_groups)
MODELS = [("bamba-9b", 128, 64, 128, 1), ("mamba2-2.7b", 80, 64, 128, 1)]
CHUNK_SIZE = 256  # both models' mamba chunk_size
TIME_BUDGET_S = 85.0
SWEEP = [
    {"maxnreg": 168},
    {"num_warps": 8},
    {"block_p": 32},
    {"block_p": 32, "num_warps": 8},
    {"num_stages": 1},
    {"num_stages": 3},
    {"block_t": 32},
    {"block": 32},
    {"block": 32, "num_warps": 8},
    {"chunk": 128},
    {"chunk": 128, "num_warps": 8},
]

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", default="bench_ssd.json", help="path of the JSON results file")
ARGS.add_argument(
    "--sections",
    default="accuracy,graph,sizes,profile,sweep",
    help="comma-separated subset of: accuracy, graph, sizes, compare, profile, sweep",
)
ARGS.add_argument("--budget", type=float, default=85.0, help="seconds before the sweep stops")
ARGS.add_argument("--sweep", default=None, help="JSON list of launch-config overrides to sweep")
ARGS.add_argument(
    "--compare",
    default=None,
    help="path of another ssd_scan.py (e.g. the previous commit's) to time beside this one",
)
DEV = torch.device("cuda")


def make_inputs(
    lengths: list[int],
    H: int,
    P: int,
    N: int,
    G: int,
    init: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Fresh random inputs with Mamba2-like scales (dt 0.001..0.1, A in [-16, -1])."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, S = sum(lengths), len(lengths)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype):
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    dt_init = torch.exp(
        torch.rand(H, generator=gen, device=DEV) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    )
    cu = torch.tensor([0, *lengths], device=DEV).cumsum(0).to(torch.int32)
    return dict(
        x=rand(T, H, P),
        dt=rand(T, H, scale=0.5),
        A=-torch.exp(torch.rand(H, generator=gen, device=DEV) * math.log(16.0)),
        B=rand(T, G, N),
        C=rand(T, G, N),
        D=torch.ones(H, device=DEV),
        dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
        cu_seqlens=cu,
        # one spare slot, so a sequence never reads a slot another one writes
        ssm_state=rand(S + 1, H, P, N, scale=0.1, dtype=torch.float32),
        state_slots=torch.arange(1, S + 1, dtype=torch.int32, device=DEV),
        has_initial_state=torch.full((S,), init, dtype=torch.bool, device=DEV),
    )


def call(fn: Callable[..., torch.Tensor], inp: dict[str, Any]) -> torch.Tensor:
    return fn(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=inp["cu_seqlens"],
        ssm_state=inp["ssm_state"],
        state_slots=inp["state_slots"],
        has_initial_state=inp["has_initial_state"],
        dt_bias=inp["dt_bias"],
        dt_softplus=True,
        chunk_size=CHUNK_SIZE,
    )


def costs(T: int, S: int, H: int, P: int, N: int, G: int, chunk: int) -> dict[str, float]:
    """Essential bytes and FLOP (floor), and the bytes this design moves."""
    essential = 2 * T * H * P * 2 + T * H * 2 + 2 * T * G * N * 2 + 2 * S * H * P * N * 4
    # FLOP as in bench_kernels.py (64-token chunks), so floors compare across scripts
    flops = T * H * (2 * 64 * P + 4 * N * P) + T * G * 2 * 64 * N
    chunks = triton.cdiv(T, chunk) + S
    # dt and its cumsum (float32, written once, read twice); C.B^T per chunk and group
    # (written, read). Chained states stay in L2 (a two-deep ring per head) and x's second
    # read comes from L2 (the same program read it moments before), so neither counts.
    design = essential + T * H * 4 * 2 * 3 + chunks * G * chunk * chunk * 2 * 2
    return {
        "bytes": essential,
        "flops": flops,
        "design_bytes": design,
        "floor_ms": max(essential / COPY_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e3,
        "design_mem_ms": design / COPY_BYTES_PER_S * 1e3,
    }


def check_accuracy() -> None:
    """(a) Triton against the twin run on float32 copies of the same inputs."""
    for name, H, P, N, G in MODELS:
        for label, lengths, init, dtype in (
            ("1 seq", [4096], True, torch.bfloat16),
            ("8 seqs", [512 - 37, 1, 700, 300, 64, 1100, 900, 530 + 26], True, torch.bfloat16),
            ("1 seq no init", [4096], False, torch.bfloat16),
            # float32 and fp16 inputs overwrite contributions with entering states in place
            ("1 seq float32", [4096], True, torch.float32),
            ("8 seqs fp16", [512] * 8, True, torch.float16),
        ):
            if dtype != torch.bfloat16 and name != MODELS[0][0]:
                continue
            inp = make_inputs(lengths, H, P, N, G, init, seed=len(lengths), dtype=dtype)
            ref_inp = {k: (v.float() if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
            ref_inp["ssm_state"] = inp["ssm_state"].clone()
            y_ref = call(ssd_mod.ssd_scan_varlen_ref, ref_inp)
            y = call(ssd_mod.ssd_scan_varlen_triton, inp)
            torch.cuda.synchronize()
            record_check(
                f"{name} T=4096 {label}",
                {"y": rel_err(y, y_ref), "state": rel_err(inp["ssm_state"], ref_inp["ssm_state"])},
            )
        # resumed mid-chunk equals whole, both on the kernel
        inp = make_inputs([4096], H, P, N, G, False, seed=9)
        y_whole = call(ssd_mod.ssd_scan_varlen_triton, inp)
        state_whole = inp["ssm_state"][1].clone()
        T = inp["x"].shape[0]
        split = T // 2 + 29
        parts = []
        for lo, hi, init in ((0, split, False), (split, T, True)):
            part = {k: (v[lo:hi] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
            part["cu_seqlens"] = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEV)
            part["has_initial_state"] = torch.tensor([init], device=DEV)
            parts.append(call(ssd_mod.ssd_scan_varlen_triton, part))
        record_check(
            f"{name} resumed at {split} == whole",
            {
                "y": rel_err(torch.cat(parts), y_whole),
                "state": rel_err(inp["ssm_state"][1], state_whole),
            },
        )


def check_cuda_graph() -> None:
    """(b) Capture one call in a CUDA graph (fails on any host sync) and replay it."""
    name, H, P, N, G = MODELS[0]
    for lengths in ([4096], [512] * 8):
        inp = make_inputs(lengths, H, P, N, G, True, seed=3)
        graph = graph_replay_check(
            f"{name} CUDA graph replay == eager, {len(lengths)} seq(s)",
            lambda inp=inp: call(ssd_mod.ssd_scan_varlen_triton, inp),
            inp["ssm_state"],
        )
        ms = bench_ms(graph.replay)
        T = sum(lengths)
        record_time(
            f"{name} T={T} {len(lengths)} seq(s) graph replay", ms, T, len(lengths), H, P, N, G
        )
        del graph


def record_time(
    label: str, ms: float, T: int, S: int, H: int, P: int, N: int, G: int, **extra: Any
) -> None:
    chunk = ssd_mod._launch_config(None, S, H, P, N, CHUNK_SIZE)["chunk"]
    c = costs(T, S, H, P, N, G, extra.get("config", {}).get("chunk", chunk))
    row = {"name": label, "ms": ms, "tokens": T, "seqs": S, **c, **extra}
    RESULTS["timings"].append(row)
    log(
        f"time {label:52s} {ms:8.3f} ms  floor {c['floor_ms']:.3f}  "
        f"design-mem {c['design_mem_ms']:.3f}  ({ms / c['floor_ms']:.1f}x floor)"
    )


def time_sizes() -> None:
    """(c) The target sizes."""
    for name, H, P, N, G in MODELS:
        layouts = [
            ("1 seq", [4096]),
            ("8 x 4k", [4096] * 8),
            ("1 seq", [32768]),
            ("1 seq", [131072]),
        ]
        for label, lengths in layouts:
            inp = make_inputs(lengths, H, P, N, G, True)
            ms = bench_ms(lambda inp=inp: call(ssd_mod.ssd_scan_varlen_triton, inp))
            T = sum(lengths)
            config = ssd_mod._launch_config(inp["x"], len(lengths), H, P, N, CHUNK_SIZE)
            record_time(
                f"{name} T={T} {label}", ms, T, len(lengths), H, P, N, G, model=name, config=config
            )
            del inp


def time_compared(path: str) -> None:
    """(c') The same 32k / 4k cases through another version of ssd_scan.py, for A/B."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ssd_compared", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    name, H, P, N, G = MODELS[0]
    for lengths in ([4096], [32768]):
        inp = make_inputs(lengths, H, P, N, G, True)
        ref_inp = {**inp, "ssm_state": inp["ssm_state"].clone()}
        y_this = call(ssd_mod.ssd_scan_varlen_triton, ref_inp)
        y_other = call(other.ssd_scan_varlen_triton, inp)
        record_check(
            f"{name} T={sum(lengths)} this == {path}",
            {
                "y": rel_err(y_this, y_other),
                "state": rel_err(ref_inp["ssm_state"], inp["ssm_state"]),
            },
        )
        ms = bench_ms(lambda inp=inp: call(other.ssd_scan_varlen_triton, inp))
        record_time(f"{name} T={sum(lengths)} compared: {path}", ms, sum(lengths), 1, H, P, N, G)


def compare_kernels() -> None:
    """(c'') The Gluon kernel (sm_90 default) against the Triton-language kernel, both under
    CUDA-graph replay (no host time), from 1k to 32k tokens and 8 varlen sequences."""
    import os

    for name, H, P, N, G in MODELS:
        for lengths in (
            [1024],
            [2048],
            [4096],
            [8192],
            [32768],
            [512 - 37, 1, 700, 300, 64, 1100, 900, 530 + 26],
        ):
            inp = make_inputs(lengths, H, P, N, G, True, seed=5)
            T = sum(lengths)
            times = {}
            for kernel, flag in (("gluon", "1"), ("triton-language", "0")):
                os.environ["SSMSERVE_SSD_GLUON"] = flag
                graph = graph_replay_check(
                    f"{name} T={T} {len(lengths)} seq(s) {kernel} graph replay == eager",
                    lambda inp=inp: call(ssd_mod.ssd_scan_varlen_triton, inp),
                    inp["ssm_state"],
                )
                times[kernel] = bench_ms(graph.replay)
                record_time(
                    f"{name} T={T} {len(lengths)} seq(s) {kernel}, graph",
                    times[kernel],
                    T,
                    len(lengths),
                    H,
                    P,
                    N,
                    G,
                    kernel=kernel,
                )
                del graph
            os.environ.pop("SSMSERVE_SSD_GLUON")
            log(f"  gluon / triton-language: {times['gluon'] / times['triton-language']:.2f}")


def profile_kernels() -> None:
    """(d) GPU time of each of the five launches in one 32k call (Bamba-9B dims)."""
    from torch.profiler import ProfilerActivity, profile

    name, H, P, N, G = MODELS[0]
    inp = make_inputs([32768], H, P, N, G, True)
    call(ssd_mod.ssd_scan_varlen_triton, inp)
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call(ssd_mod.ssd_scan_varlen_triton, inp)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            ms = evt.time_range.elapsed_us() / 1e3 / reps
            totals[evt.name] = totals.get(evt.name, 0.0) + ms
    for kernel, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        RESULTS["kernels"].append({"kernel": kernel, "ms": ms, "case": f"{name} T=32768"})
        log(f"kernel {kernel[:60]:60s} {ms:8.3f} ms")


def sweep_configs() -> None:
    """(e) Launch configs at 32k tokens, one sequence, Bamba-9B dims."""
    name, H, P, N, G = MODELS[0]
    inp = make_inputs([32768], H, P, N, G, True)
    default = ssd_mod._launch_config
    # The timed calls update inp's state pool in place (initial states on): every check
    # starts from a copy of the pool as it was before any of them.
    pool = inp["ssm_state"].clone()
    y_default = call(ssd_mod.ssd_scan_varlen_triton, {**inp, "ssm_state": pool.clone()})
    try:
        for override in SWEEP:
            if elapsed_s() > TIME_BUDGET_S:
                log(f"sweep: time budget spent, skipping {override}")
                continue
            cfg = {**default(inp["x"], 1, H, P, N, override.get("chunk", CHUNK_SIZE))}
            cfg.update(override)
            ssd_mod._launch_config = lambda *a, cfg=cfg, **k: cfg
            try:
                y = call(
                    ssd_mod.ssd_scan_varlen_triton, {**inp, "ssm_state": inp["ssm_state"].clone()}
                )
                record_check(
                    f"sweep {json.dumps(override)} == default", {"y": rel_err(y, y_default)}
                )
                ms = bench_ms(lambda: call(ssd_mod.ssd_scan_varlen_triton, inp))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                log(f"sweep {cfg}: failed: {str(exc)[:300]}")
                RESULTS["errors"].append({"section": f"sweep {cfg}", "traceback": str(exc)[:3000]})
                continue
            record_time(
                f"sweep {name} T=32768 " + json.dumps(override),
                ms,
                32768,
                1,
                H,
                P,
                N,
                G,
                config=cfg,
            )
    finally:
        ssd_mod._launch_config = default


def main() -> None:
    opts = ARGS.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_ssd.py needs a CUDA GPU")
    RESULTS["env"] = environment(
        default_config=ssd_mod._launch_config(None, 1, 128, 64, 128, CHUNK_SIZE)
    )
    log(json.dumps(RESULTS["env"]))
    global TIME_BUDGET_S, SWEEP
    TIME_BUDGET_S = opts.budget
    if opts.sweep:
        SWEEP = json.loads(opts.sweep)
    named = {
        "accuracy": check_accuracy,
        "graph": check_cuda_graph,
        "sizes": time_sizes,
        "compare": compare_kernels,
        "profile": profile_kernels,
        "sweep": sweep_configs,
    }
    sections = [named[name] for name in opts.sections.split(",")]
    if opts.compare:
        compared = functools.partial(time_compared, opts.compare)
        compared.__name__ = "time_compared"
        sections.append(compared)
    run_sections(sections)
    finish(
        opts.out,
        ["case", "ms", "floor ms", "x floor", "design-mem ms"],
        lambda r: [
            r["name"],
            f"{r['ms']:.3f}",
            f"{r['floor_ms']:.3f}",
            f"{r['ms'] / r['floor_ms']:.1f}",
            f"{r['design_mem_ms']:.3f}",
        ],
    )


if __name__ == "__main__":
    main()
