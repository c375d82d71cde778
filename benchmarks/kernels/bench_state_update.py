"""How fast is the one-token selective state update (Mamba1 and Mamba2 decode), next to
its floor?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_state_update.py          # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_state_update.py --tiny   # CPU smoke run

Bamba-9B (128 heads of 64, d_state 128) and Mamba2-2.7B (80 heads) mixer dims, and Mamba1's
layout (one channel per "head", head dim 1: Jamba-Mini-1.7's 8192 channels and Mamba-2.8B's
5120, d_state 16), bf16 inputs, float32 state pool. Sections:
- accuracy: Triton against the twin at batch 256 with padding rows (slot -1).
- sizes: batch 1 / 64 / 256, eager and as 20 calls under one CUDA-graph replay (how the
  engine decodes: no launch overhead). Successive calls rotate over slot sets, so small
  batches read the pool from HBM, as successive layers do, not from L2.
- sweep: launch parameters (`config=`).
Floor: the state read and written once (float32) at the copy rate; the other operands
are small next to it.
"""

from __future__ import annotations

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

from ssmserve.kernels.state_update import (
    selective_state_update_ref,
    selective_state_update_triton,
    update_launch_config,
)

SECTIONS = ("accuracy", "sizes", "sweep")
OPTS = parse_args(__doc__, SECTIONS)
# (name, heads, head_dim, d_state, n_groups)
MODELS = [
    ("bamba-9b", 128, 64, 128, 1),
    ("mamba2-2.7b", 80, 64, 128, 1),
    ("jamba-mini-1.7", 8192, 1, 16, 1),
    ("mamba-2.8b", 5120, 1, 16, 1),
]
BATCHES, CHECK_BATCH = (1, 64, 256), 256
SWEEP = [{"block_p": 8}, {"block_p": 32}, {"block_p": 64, "num_warps": 8}, {"num_warps": 2}]
GRAPH_CALLS = 20
if OPTS.tiny:
    MODELS = [("tiny", 4, 16, 16, 1), ("tiny-groups", 4, 8, 8, 2), ("tiny-mamba1", 24, 1, 5, 1)]
    BATCHES, CHECK_BATCH, GRAPH_CALLS = (1, 4), 8, 2


def make_inputs(Bt: int, H: int, P: int, N: int, G: int, num_slots: int) -> dict[str, Any]:
    """Mamba2's layout: dt, A, D and dt_bias per head, expanded with stride 0; with P = 1
    Mamba1's: dt, A, D and dt_bias per channel."""
    gen = torch.Generator(device=DEV).manual_seed(Bt)

    def rand(*shape: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    if P == 1:
        return dict(
            ssm_state=rand(num_slots, H, 1, N, dtype=torch.float32, scale=0.1),
            x=rand(Bt, H, 1),
            dt=rand(Bt, H, 1),
            A=-torch.exp(rand(H, 1, N, dtype=torch.float32)),
            B=rand(Bt, G, N),
            C=rand(Bt, G, N),
            D=rand(H, 1, dtype=torch.float32),
            z=rand(Bt, H, 1),
            dt_bias=rand(H, 1, dtype=torch.float32),
        )
    return dict(
        ssm_state=rand(num_slots, H, P, N, dtype=torch.float32, scale=0.1),
        x=rand(Bt, H, P),
        dt=rand(Bt, H)[:, :, None].expand(Bt, H, P),
        A=(-torch.exp(rand(H, dtype=torch.float32)))[:, None, None].expand(H, P, N),
        B=rand(Bt, G, N),
        C=rand(Bt, G, N),
        D=rand(H, dtype=torch.float32)[:, None].expand(H, P),
        z=rand(Bt, H, P),
        dt_bias=rand(H, dtype=torch.float32)[:, None].expand(H, P),
    )


def floor(Bt: int, H: int, P: int, N: int) -> float:
    return floor_ms(Bt * 2 * H * P * N * 4)


def accuracy() -> None:
    for name, H, P, N, G in MODELS:
        inp = make_inputs(CHECK_BATCH, H, P, N, G, CHECK_BATCH + 8)
        slots = torch.randperm(CHECK_BATCH + 8, device=DEV)[:CHECK_BATCH]
        slots[::7] = -1
        pool = inp["ssm_state"].clone()
        y_ref = selective_state_update_ref(**inp, state_slots=slots)
        state_ref, inp["ssm_state"] = inp["ssm_state"], pool
        y = selective_state_update_triton(**inp, state_slots=slots)
        errors = {"y": rel_err(y, y_ref), "state": rel_err(pool, state_ref)}
        record_check(f"{name} batch={CHECK_BATCH} (padding rows)", errors)


def time_batches(configs: list[dict[str, Any]]) -> None:
    for name, H, P, N, G in MODELS:
        for Bt in BATCHES:
            # Rotate over slot sets so small batches read HBM, not L2 (as across layers).
            rounds = max(2, min(64, (512 << 20) // (Bt * H * P * N * 4)))
            inp = make_inputs(Bt, H, P, N, G, Bt * rounds)
            slot_sets = [
                torch.arange(Bt, dtype=torch.int32, device=DEV) + r * Bt for r in range(rounds)
            ]
            for override in configs:
                cfg = update_launch_config(P, N, override)
                step = [0]

                def run(inp=inp, slot_sets=slot_sets, step=step, cfg=cfg) -> torch.Tensor:
                    step[0] = (step[0] + 1) % len(slot_sets)
                    slots = slot_sets[step[0]]
                    return selective_state_update_triton(**inp, state_slots=slots, config=cfg)

                label = f"{name} batch={Bt} fp32 state {json.dumps(override)}"
                record_time(f"{label} eager", bench_ms(run), floor(Bt, H, P, N), config=cfg)
                if DEV.type == "cuda":
                    graph, _ = capture(
                        lambda inp=inp, sets=slot_sets, cfg=cfg: [
                            selective_state_update_triton(
                                **inp, state_slots=sets[i % len(sets)], config=cfg
                            )
                            for i in range(GRAPH_CALLS)
                        ]
                    )
                    ms = bench_ms(graph.replay) / GRAPH_CALLS
                    record_time(f"{label} graph", ms, floor(Bt, H, P, N), config=cfg)
                    del graph
                else:
                    log("graph timing: no GPU, skipped")
            del inp


def sizes() -> None:
    time_batches([{}])


def sweep() -> None:
    time_batches(SWEEP)


def main() -> None:
    name, H, P, N, G = MODELS[0]
    environment(OPTS, default_config=update_launch_config(P, N))
    run_sections(OPTS, dict(accuracy=accuracy, sizes=sizes, sweep=sweep))
    finish(OPTS, "state_update", "Selective state update (decode)")


if __name__ == "__main__":
    main()
