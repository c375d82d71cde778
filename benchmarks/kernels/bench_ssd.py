"""How fast is the varlen SSD scan (Mamba2 prefill), next to its floor?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_ssd.py                 # GPU, every section
    PYTHONPATH=$PWD python benchmarks/kernels/bench_ssd.py --tiny          # CPU smoke run

Bamba-9B and Mamba2-2.7B mixer dims (128 / 80 heads of 64, d_state 128, one group), bf16,
256-token chunks. Sections:
- accuracy: the served op (kernel_backend "auto": the Gluon kernel on sm_90) and the
  Triton-language kernel against the float32 twin; a sequence resumed mid-chunk against
  the whole; float32 and fp16 inputs.
- graph: CUDA-graph capture and replay (fails on any host sync), bit-identical to eager.
- sizes: the served op at 4k / 8 x 4k / 32k / 128k tokens.
- compare: the Gluon kernel (`hopper`) against the Triton-language kernel (`triton`), both
  under graph replay, 1k to 32k tokens and 8 varlen sequences (sm_90 only).
- profile: GPU time per launch of one 32k call.
- sweep: launch parameters of the Triton-language kernel at 32k (`config=`; --sweep).
Floors: the bytes a scan must move (x, B, C, dt read, y written, states in and out) at
the copy rate, or its FLOP at the bf16 rate, whichever is larger (bench_common).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from bench_common import (
    DEV,
    bench_ms,
    environment,
    finish,
    floor_ms,
    graph_replay_check,
    kernel_ops,
    log,
    parse_args,
    profile_ms,
    record_check,
    record_time,
    rel_err,
    run_sections,
)

from ssmserve.kernels.ssd_scan import (
    chunk_tokens,
    scan_launch_config,
    ssd_scan_varlen_ref,
    ssd_scan_varlen_triton,
)

SECTIONS = ("accuracy", "graph", "sizes", "compare", "profile", "sweep")
SWEEP = [
    {"maxnreg": 168},
    {"maxnreg": None},
    {"num_warps": 4},
    {"block_p": 32},
    {"num_stages": 2},
    {"block_t": 32},
    {"block": 32},
]
OPTS = parse_args(
    __doc__,
    SECTIONS,
    lambda p: p.add_argument(
        "--sweep", default=None, help="JSON list of launch-parameter overrides to time"
    ),
)
# (name, heads, head_dim, d_state, n_groups)
MODELS = [("bamba-9b", 128, 64, 128, 1), ("mamba2-2.7b", 80, 64, 128, 1)]
CHUNK_SIZE = 256
CHECK_T, LONG_T = 4096, 32768
SPLIT = 2077  # where the resumed check splits a CHECK_T-token sequence: mid-chunk
if OPTS.tiny:
    MODELS = [("tiny", 4, 16, 16, 1), ("tiny-groups", 4, 8, 16, 2)]
    CHUNK_SIZE, CHECK_T, LONG_T, SPLIT = 16, 40, 64, 23
OPS = kernel_ops()


def make_inputs(
    lengths: list[int], H: int, P: int, N: int, G: int, init: bool, seed: int = 0, dtype=None
) -> dict[str, Any]:
    """Random inputs with Mamba2-like scales (dt 0.001..0.1, A in [-16, -1])."""
    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(seed)
    T, S = sum(lengths), len(lengths)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    dt_init = torch.exp(
        torch.rand(H, generator=gen, device=DEV) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    )
    return dict(
        x=rand(T, H, P),
        dt=rand(T, H, scale=0.5),
        A=-torch.exp(torch.rand(H, generator=gen, device=DEV) * math.log(16.0)),
        B=rand(T, G, N),
        C=rand(T, G, N),
        D=torch.ones(H, device=DEV),
        dt_bias=dt_init + torch.log(-torch.expm1(-dt_init)),  # inverse softplus
        cu_seqlens=torch.tensor([0, *lengths], device=DEV).cumsum(0).to(torch.int32),
        # one spare slot, so a sequence never reads a slot another one writes
        ssm_state=rand(S + 1, H, P, N, scale=0.1, dtype=torch.float32),
        state_slots=torch.arange(1, S + 1, dtype=torch.int32, device=DEV),
        has_initial_state=torch.full((S,), init, dtype=torch.bool, device=DEV),
    )


def call(fn, inp: dict[str, Any], **kw: Any) -> torch.Tensor:
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
        chunk_size=CHUNK_SIZE,
        **kw,
    )


def floor(T: int, S: int, H: int, P: int, N: int, G: int) -> float:
    """x, B, C (bf16) and dt read, y written, states in and out (float32); the FLOP of the
    chunked form at 64-token blocks."""
    nbytes = 2 * T * H * P * 2 + T * H * 2 + 2 * T * G * N * 2 + 2 * S * H * P * N * 4
    flops = T * H * (2 * 64 * P + 4 * N * P) + T * G * 2 * 64 * N
    return floor_ms(nbytes, flops)


def time_case(label: str, lengths: list[int], dims: tuple, ms: float, **extra: Any) -> None:
    H, P, N, G = dims
    record_time(label, ms, floor(sum(lengths), len(lengths), H, P, N, G), **extra)


def ragged(T: int) -> list[int]:
    """Seven sequences summing to T: one empty, one of one token, the rest uneven."""
    q = T // 4
    lengths = [q - q // 3, 1, q + q // 2, q // 2, 0, q // 3]
    return [*lengths, T - sum(lengths)]


def accuracy() -> None:
    """The served op and the Triton-language kernel against the twin on float32 copies."""
    for name, H, P, N, G in MODELS:
        for label, lengths, init, dtype in (
            ("1 seq", [CHECK_T], True, torch.bfloat16),
            ("7 ragged seqs", ragged(CHECK_T), True, torch.bfloat16),
            ("1 seq no init", [CHECK_T], False, torch.bfloat16),
            ("1 seq float32", [CHECK_T], True, torch.float32),
            ("8 seqs fp16", [CHECK_T // 8] * 8, True, torch.float16),
        ):
            if dtype != torch.bfloat16 and name != MODELS[0][0]:
                continue
            inp = make_inputs(lengths, H, P, N, G, init, seed=len(lengths), dtype=dtype)
            ref = {k: (v.float() if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
            ref["ssm_state"] = inp["ssm_state"].clone()
            y_ref = call(ssd_scan_varlen_ref, ref)
            fns = {OPS.backend: OPS.ssd_scan_varlen, "triton": ssd_scan_varlen_triton}
            for backend, fn in fns.items():
                run = {**inp, "ssm_state": inp["ssm_state"].clone()}
                y = call(fn, run)
                errors = {
                    "y": rel_err(y, y_ref),
                    "state": rel_err(run["ssm_state"], ref["ssm_state"]),
                }
                record_check(f"{name} T={sum(lengths)} {label} ({backend})", errors)
        # resumed mid-chunk equals whole, both through the served op
        inp = make_inputs([CHECK_T], H, P, N, G, False, seed=9)
        y_whole = call(OPS.ssd_scan_varlen, inp)
        state_whole = inp["ssm_state"][1].clone()
        parts = []
        for lo, hi, init in ((0, SPLIT, False), (SPLIT, CHECK_T, True)):
            part = {k: (v[lo:hi] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
            part["cu_seqlens"] = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEV)
            part["has_initial_state"] = torch.tensor([init], device=DEV)
            start = torch.tensor([lo], device=DEV)
            parts.append(call(OPS.ssd_scan_varlen, part, start_positions=start))
        errors = {"y": rel_err(torch.cat(parts), y_whole)}
        errors["state"] = rel_err(inp["ssm_state"][1], state_whole)
        record_check(f"{name} resumed at {SPLIT} == whole ({OPS.backend})", errors)


def graph() -> None:
    """Capture and replay one call of the served op; time the replay."""
    if DEV.type != "cuda":
        log("graph: no GPU, skipped")
        return
    name, H, P, N, G = MODELS[0]
    for lengths in ([CHECK_T], [CHECK_T // 8] * 8):
        inp = make_inputs(lengths, H, P, N, G, True, seed=3)
        fn = lambda inp=inp: call(OPS.ssd_scan_varlen, inp)  # noqa: E731
        label = f"{name} T={sum(lengths)} {len(lengths)} seq(s) ({OPS.backend}) graph replay"
        g = graph_replay_check(label + " == eager", fn, inp["ssm_state"])
        time_case(label, lengths, (H, P, N, G), bench_ms(g.replay), backend=OPS.backend)
        del g


def sizes() -> None:
    """The served op, eager, at the sizes a prefill meets."""
    for name, H, P, N, G in MODELS:
        for label, lengths in (
            ("1 seq", [CHECK_T]),
            ("8 seqs", [CHECK_T] * 8),
            ("1 seq", [LONG_T]),
            ("1 seq", [4 * LONG_T]),
        ):
            inp = make_inputs(lengths, H, P, N, G, True)
            fn = lambda inp=inp: call(OPS.ssd_scan_varlen, inp)  # noqa: E731
            time_case(
                f"{name} T={sum(lengths)} {label} ({OPS.backend})",
                lengths,
                (H, P, N, G),
                bench_ms(fn),
                model=name,
                backend=OPS.backend,
            )
            del inp


def compare() -> None:
    """hopper against triton, both under graph replay (no host time)."""
    if OPS.backend != "hopper":
        log(f"compare: the served backend here is {OPS.backend!r}, not 'hopper'; skipped")
        return
    for name, H, P, N, G in MODELS:
        for lengths in (
            [LONG_T // 32],
            [LONG_T // 8],
            [LONG_T],
            ragged(LONG_T // 8),
        ):
            inp = make_inputs(lengths, H, P, N, G, True, seed=5)
            times = {}
            for backend, fn in (
                ("hopper", OPS.ssd_scan_varlen),
                ("triton", ssd_scan_varlen_triton),
            ):
                label = f"{name} T={sum(lengths)} {len(lengths)} seq(s) ({backend}) graph replay"
                g = graph_replay_check(
                    label + " == eager", lambda inp=inp, fn=fn: call(fn, inp), inp["ssm_state"]
                )
                times[backend] = bench_ms(g.replay)
                time_case(label, lengths, (H, P, N, G), times[backend], backend=backend)
                del g
            log(f"  hopper / triton: {times['hopper'] / times['triton']:.2f}")


def profile() -> None:
    name, H, P, N, G = MODELS[0]
    inp = make_inputs([LONG_T], H, P, N, G, True)
    profile_ms(lambda: call(OPS.ssd_scan_varlen, inp), f"{name} T={LONG_T} ({OPS.backend})")


def sweep() -> None:
    """Launch parameters of the Triton-language kernel, each checked against its defaults."""
    name, H, P, N, G = MODELS[0]
    inp = make_inputs([LONG_T], H, P, N, G, True)
    pool = inp["ssm_state"].clone()  # every run starts from the same states
    default = scan_launch_config(inp["x"].dtype, chunk_tokens(CHUNK_SIZE))
    y_default = call(ssd_scan_varlen_triton, {**inp, "ssm_state": pool.clone()})
    for override in json.loads(OPTS.sweep) if OPTS.sweep else [{}, *SWEEP]:
        label = f"sweep {name} T={LONG_T} (triton) {json.dumps(override)}"
        try:
            y = call(ssd_scan_varlen_triton, {**inp, "ssm_state": pool.clone()}, config=override)
            record_check(f"{label} == defaults", {"y": rel_err(y, y_default)})
            fn = lambda o=override: call(ssd_scan_varlen_triton, inp, config=o)  # noqa: E731
            ms = bench_ms(fn)
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory or registers
            log(f"{label}: failed: {str(exc)[:300]}")
            continue
        time_case(label, [LONG_T], (H, P, N, G), ms, config={**default, **override})


def main() -> None:
    dtype = torch.bfloat16
    environment(
        OPTS,
        backend=OPS.backend,
        triton_default_config=scan_launch_config(dtype, chunk_tokens(CHUNK_SIZE)),
    )
    named = dict(
        accuracy=accuracy, graph=graph, sizes=sizes, compare=compare, profile=profile, sweep=sweep
    )
    run_sections(OPTS, named)
    finish(OPTS, "ssd", "SSD varlen scan")


if __name__ == "__main__":
    main()
