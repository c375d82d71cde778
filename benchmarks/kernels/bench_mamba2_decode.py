"""How fast is the fused Mamba2 decode step (conv update + state update in one launch),
next to the two launches it replaces and to its floor?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_mamba2_decode.py          # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_mamba2_decode.py --tiny   # CPU smoke run

Bamba-9B (128 heads of 64, d_state 128, one group, conv width 4, conv dim 8192 + 256) and
Mamba2-2.7B (80 heads of 64, d_state 128, one group) mixer dims, bf16 inputs and conv
state, float32 SSM state. Sections:
- accuracy: the fused kernel against its twin and against the unfused kernels at batch
  256 with padding rows (slot -1) and slots in permuted order; a CUDA-graph replay
  against the eager call, bit for bit; the arrival counters back to zero.
- sizes: batch 1 / 64 / 256 / 484, fused against conv update + state update, each as 20
  calls under one CUDA-graph replay (how the engine decodes: no launch overhead).
  Successive calls rotate over slot sets, so small batches read the pools from HBM, as
  successive layers do, not from L2.
- sweep: launch parameters of the fused kernel (`config=`).
Floor: the SSM state (float32) and conv window (bf16) read and written once, the conv
inputs and dt read and y written once, at the copy rate.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from bench_common import (
    DEV,
    bench_ms,
    capture,
    environment,
    finish,
    floor_ms,
    log,
    parse_args,
    record_check,
    record_time,
    rel_err,
    run_sections,
)

from ssmserve.kernels import mamba2_decode
from ssmserve.kernels.causal_conv1d import causal_conv1d_update_triton
from ssmserve.kernels.mamba2_decode import (
    conv_then_state_update,
    decode_update_launch_config,
    mamba2_decode_update_ref,
    mamba2_decode_update_triton,
)
from ssmserve.kernels.state_update import selective_state_update_triton

SECTIONS = ("accuracy", "sizes", "sweep")
OPTS = parse_args(__doc__, SECTIONS)
# (name, heads, head_dim, d_state, n_groups)
MODELS = [("bamba-9b", 128, 64, 128, 1), ("mamba2-2.7b", 80, 64, 128, 1)]
K = 4
BATCHES, CHECK_BATCH, SWEEP_BATCHES = (1, 64, 256, 484), 256, (1, 64, 256)
SWEEP = [
    {"heads_per_program": 1},
    {"heads_per_program": 4},
    {"heads_per_program": 16},
    {"block_p": 8},
    {"block_p": 16},
    {"block_p": 16, "num_warps": 2},
    {"block_p": 64},
    {"num_warps": 8},
    {"block_p": 64, "num_warps": 8},
]
GRAPH_CALLS = 20
if OPTS.tiny:
    MODELS = [("tiny", 4, 8, 8, 1), ("tiny-groups", 6, 5, 8, 2)]
    BATCHES, CHECK_BATCH, SWEEP_BATCHES, GRAPH_CALLS = (1, 3), 6, (3,), 2
    SWEEP = [{"block_p": 2, "heads_per_program": 2}]

unfused_triton = functools.partial(
    conv_then_state_update, causal_conv1d_update_triton, selective_state_update_triton
)


def fn_config(fn) -> dict[str, Any] | None:
    """The launch override a timed path passes (None: the defaults, or the unfused path)."""
    return fn.keywords.get("config") if isinstance(fn, functools.partial) else None


def make_inputs(Bt: int, H: int, P: int, N: int, G: int, num_rows: int) -> dict[str, Any]:
    """One layer's decode arguments (state_slots apart), the Mamba2 mixer's layout."""
    gen = torch.Generator(device=DEV).manual_seed(Bt)
    conv_dim = H * P + 2 * G * N

    def rand(*shape: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    return dict(
        xbc=rand(Bt, conv_dim),
        conv_state=rand(num_rows, conv_dim, K - 1),
        conv_weight=rand(conv_dim, K, scale=0.5),
        conv_bias=rand(conv_dim),
        ssm_state=rand(num_rows, H, P, N, dtype=torch.float32, scale=0.1),
        dt=rand(Bt, H),
        A=-torch.exp(rand(H, dtype=torch.float32)),
        D=rand(H, dtype=torch.float32),
        dt_bias=rand(H, dtype=torch.float32),
        n_groups=G,
    )


def floor(Bt: int, H: int, P: int, N: int, G: int) -> float:
    conv_dim = H * P + 2 * G * N
    state = 2 * H * P * N * 4  # float32, read and written
    window = 2 * conv_dim * (K - 1) * 2  # bf16, read and written
    vectors = (conv_dim + H + H * P) * 2  # xbc and dt read, y written (bf16)
    return floor_ms(Bt * (state + window + vectors))


def counters_zero() -> bool:
    return all(
        int(buf.abs().sum()) == 0
        for buffers in mamba2_decode._ARRIVAL_COUNTERS.values()
        for buf in buffers
    )


def accuracy() -> None:
    for name, H, P, N, G in MODELS:
        inp = make_inputs(CHECK_BATCH, H, P, N, G, CHECK_BATCH + 8)
        slots = torch.randperm(CHECK_BATCH + 8, device=DEV)[:CHECK_BATCH]
        slots[::7] = -1
        start = {k: inp[k].clone() for k in ("conv_state", "ssm_state")}
        results = {}
        for label, fn in (
            ("twin", mamba2_decode_update_ref),
            ("unfused", unfused_triton),
            ("fused", mamba2_decode_update_triton),
        ):
            pools = {k: v.clone() for k, v in start.items()}
            y = fn(**{**inp, **pools}, state_slots=slots)
            results[label] = (y, pools["conv_state"], pools["ssm_state"])
        y, conv, ssm = results["fused"]
        # The interpreter rounds float32 to bf16 inexactly (the twin rounds to nearest),
        # which shows in the bf16 conv outputs: there the twin agrees to a looser limit.
        for ref, limit in (("twin", 1e-2 if DEV.type == "cuda" else 3e-2), ("unfused", 1e-2)):
            y_ref, conv_ref, ssm_ref = results[ref]
            errors = {"y": rel_err(y, y_ref), "conv": rel_err(conv, conv_ref)}
            errors["ssm"] = rel_err(ssm, ssm_ref)
            label = f"{name} batch={CHECK_BATCH} fused vs {ref} (padding rows)"
            record_check(label, errors, limit)
        record_check(f"{name} arrival counters zero", {"nonzero": float(not counters_zero())}, 0.0)
        if DEV.type == "cuda":
            graph_replay(name, inp, slots, start, results["fused"])


def graph_replay(name: str, inp: dict[str, Any], slots: torch.Tensor, start, eager) -> None:
    """A captured call replayed from the same pools equals the eager call bit for bit."""
    pools = {k: v.clone() for k, v in start.items()}
    graph, y = capture(lambda: mamba2_decode_update_triton(**{**inp, **pools}, state_slots=slots))
    for k, v in start.items():
        pools[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    y_eager, conv_eager, ssm_eager = eager
    errors = {"y": rel_err(y, y_eager), "conv": rel_err(pools["conv_state"], conv_eager)}
    errors["ssm"] = rel_err(pools["ssm_state"], ssm_eager)
    record_check(f"{name} graph replay equals eager", errors, limit=0.0)


def time_paths(batches, configs: list[dict[str, Any]], with_unfused: bool) -> None:
    for name, H, P, N, G in MODELS:
        for Bt in batches:
            rounds = max(2, min(64, (512 << 20) // (Bt * H * P * N * 4)))
            inp = make_inputs(Bt, H, P, N, G, Bt * rounds)
            slot_sets = [
                torch.arange(Bt, dtype=torch.int32, device=DEV) + r * Bt for r in range(rounds)
            ]
            paths = [
                (f"fused {json.dumps(c)}" if c else "fused",
                 functools.partial(mamba2_decode_update_triton, config=c))
                for c in configs
            ]  # fmt: skip
            if with_unfused:
                paths.append(("conv update + state update", unfused_triton))
            how = "graph" if DEV.type == "cuda" else "interpreted"
            times = {}
            for label, fn in paths:
                full = f"{name} batch={Bt} fp32 state {label}"

                def calls(fn=fn, inp=inp, sets=slot_sets, n=GRAPH_CALLS) -> None:
                    for i in range(n):
                        fn(**inp, state_slots=sets[i % len(sets)])

                if DEV.type == "cuda":
                    graph, _ = capture(calls)
                    ms = bench_ms(graph.replay) / GRAPH_CALLS
                    del graph
                else:
                    ms = bench_ms(functools.partial(calls, n=1))
                times[label] = ms
                cfg = decode_update_launch_config(P, N, H // G, Bt * G, DEV, fn_config(fn))
                record_time(f"{full} {how}", ms, floor(Bt, H, P, N, G), config=label, launch=cfg)
            if with_unfused:
                unfused_ms = times["conv update + state update"]
                log(f"{name} batch={Bt}: unfused / fused = {unfused_ms / times['fused']:.2f}")
            del inp


def sizes() -> None:
    time_paths(BATCHES, [{}], with_unfused=True)


def sweep() -> None:
    time_paths(SWEEP_BATCHES, SWEEP, with_unfused=False)


def main() -> None:
    name, H, P, N, G = MODELS[0]
    default = decode_update_launch_config(P, N, H // G, G, DEV)
    environment(OPTS, kernel_width=K, default_config_batch_1=default)
    if DEV.type != "cuda":
        log("no GPU: one interpreted call per case, no graphs; the times mean nothing")
    run_sections(OPTS, dict(accuracy=accuracy, sizes=sizes, sweep=sweep))
    finish(OPTS, "mamba2_decode", "Fused Mamba2 decode step (conv update + state update)")


if __name__ == "__main__":
    main()
