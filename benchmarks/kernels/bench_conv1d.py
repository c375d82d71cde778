"""How fast is the causal conv1d (Mamba prefill and decode), next to its floor?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_conv1d.py          # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_conv1d.py --tiny   # CPU smoke run

Bamba-9B (conv dim 8192 + 2 x 128) and Mamba2-2.7B (5120 + 2 x 128) mixers, kernel width
4, bf16, SiLU. Sections:
- accuracy: varlen prefill (sequences shorter than the kernel, with and without
  conv state) and the one-token update with a padding row, against the twins.
- varlen: 4k and 32k tokens, one sequence with a conv state; x is a column slice of the
  in_proj output, with its row stride, as the mixers pass it.
- update: batch 1 / 64 / 256, eager and under CUDA-graph replay.
- sweep: the varlen launch parameters (`config=`) at 8k tokens, the engine's chunk.
- sweep_update: the update's launch parameters (channels a program, warps) at the
  batches of long-output decode (256 and 650 rows), under CUDA-graph replay.
Floor: x read and y written once (bf16), plus the conv states for the update.
"""

from __future__ import annotations

import torch
from bench_common import (
    DEV,
    bench_ms,
    capture,
    environment,
    finish,
    floor_ms,
    parse_args,
    record_check,
    record_time,
    rel_err,
    run_sections,
)

from ssmserve.kernels.causal_conv1d import (
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
    causal_conv1d_varlen_ref,
    causal_conv1d_varlen_triton,
    varlen_launch_config,
)

SECTIONS = ("accuracy", "varlen", "update", "sweep", "sweep_update")
OPTS = parse_args(__doc__, SECTIONS)
# (name, conv dim, in_proj width: the row stride of the conv input)
MODELS = [("bamba-9b", 8192 + 2 * 128, 16768), ("mamba2-2.7b", 5120 + 2 * 128, 10576)]
K = 4
CHECK_T, VARLEN_T, SWEEP_T, BATCHES = 8192, (4096, 32768), 8192, (1, 64, 256)
UPDATE_BATCHES = (256, 650)
UPDATE_SWEEP = [{}] + [
    dict(block_c=bc, num_warps=nw) for bc in (128, 256, 512, 1024, 2048) for nw in (2, 4, 8)
]
SWEEP = [
    dict(block_t=bt, block_c=bc, num_warps=nw)
    for bt in (16, 32, 64)
    for bc in (64, 128, 256)
    for nw in (4, 8)
    if bt * bc <= 8192
]
if OPTS.tiny:
    MODELS = [("tiny", 48, 112)]
    CHECK_T, VARLEN_T, SWEEP_T, BATCHES = 300, (64,), 64, (1, 4)
    SWEEP = SWEEP[:2]
    UPDATE_BATCHES, UPDATE_SWEEP = (3,), [{}, dict(block_c=16, num_warps=2)]


def rand(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)


def sliced_input(T: int, Cd: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """[T, Cd] columns of a [T, width] tensor, as a mixer's xBC slice of its in_proj."""
    start = (width - Cd) // 2
    return rand(T, width, gen=gen)[:, start : start + Cd]


def one_sequence(T: int) -> dict[str, torch.Tensor]:
    """The varlen metadata of one T-token sequence resuming from slot 3's conv state."""
    return dict(
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=DEV),
        state_slots=torch.tensor([3], device=DEV),
        has_initial_state=torch.tensor([True], device=DEV),
    )


def accuracy() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, Cd, _ in MODELS:
        lengths = [CHECK_T // 2, 3, 1, CHECK_T - CHECK_T // 2 - 4]
        cu = torch.tensor([0, *lengths], device=DEV).cumsum(0).to(torch.int32)
        x, w, b = rand(CHECK_T, Cd, gen=gen), rand(Cd, K, gen=gen), rand(Cd, gen=gen)
        pool = rand(6, Cd, K - 1, gen=gen)
        meta = dict(
            cu_seqlens=cu,
            state_slots=torch.tensor([5, 0, 2, 3], device=DEV),
            has_initial_state=torch.tensor([True, True, False, True], device=DEV),
        )
        pool_ref = pool.clone()
        y_ref = causal_conv1d_varlen_ref(x, w, b, conv_state=pool_ref, **meta)
        y = causal_conv1d_varlen_triton(x, w, b, conv_state=pool, **meta)
        errors = {"y": rel_err(y, y_ref), "state": rel_err(pool, pool_ref)}
        record_check(f"varlen {name} T={CHECK_T}", errors)
        slots = torch.tensor([1, -1, 4, 0], device=DEV)
        xs = rand(4, Cd, gen=gen)
        pool_ref = pool.clone()
        y_ref = causal_conv1d_update_ref(xs, pool_ref, w, b, state_slots=slots)
        y = causal_conv1d_update_triton(xs, pool, w, b, state_slots=slots)
        errors = {"y": rel_err(y, y_ref), "state": rel_err(pool, pool_ref)}
        record_check(f"update {name} (padding row)", errors)


def varlen() -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    for name, Cd, width in MODELS:
        w, b = rand(Cd, K, gen=gen), rand(Cd, gen=gen)
        for T in VARLEN_T:
            x, pool = sliced_input(T, Cd, width, gen), rand(4, Cd, K - 1, gen=gen)
            meta = one_sequence(T)
            ms = bench_ms(
                lambda x=x, pool=pool, meta=meta, w=w, b=b: causal_conv1d_varlen_triton(
                    x, w, b, conv_state=pool, **meta
                )
            )
            record_time(f"varlen {name} T={T}", ms, floor_ms(2 * T * Cd * 2))


def update() -> None:
    gen = torch.Generator(device=DEV).manual_seed(2)
    for name, Cd, _ in MODELS:
        w, b = rand(Cd, K, gen=gen), rand(Cd, gen=gen)
        for Bt in BATCHES:
            x, pool = rand(Bt, Cd, gen=gen), rand(Bt * 8, Cd, K - 1, gen=gen)
            slots = torch.arange(Bt, device=DEV) * 8  # spread over the pool
            fn = lambda x=x, pool=pool, s=slots, w=w, b=b: causal_conv1d_update_triton(  # noqa: E731
                x, pool, w, b, state_slots=s
            )
            # x read, y written; the state window read and written
            floor = floor_ms(Bt * Cd * (2 * 2 + 2 * (K - 1) * 2))
            record_time(f"update {name} batch={Bt} eager", bench_ms(fn), floor)
            if DEV.type == "cuda":
                graph, _ = capture(fn)
                record_time(f"update {name} batch={Bt} graph", bench_ms(graph.replay), floor)
                del graph


def sweep() -> None:
    gen = torch.Generator(device=DEV).manual_seed(3)
    for name, Cd, width in MODELS:
        w, b = rand(Cd, K, gen=gen), rand(Cd, gen=gen)
        x, pool = sliced_input(SWEEP_T, Cd, width, gen), rand(4, Cd, K - 1, gen=gen)
        meta = one_sequence(SWEEP_T)
        start = pool.clone()  # the timed calls below write `pool`
        want = causal_conv1d_varlen_ref(x, w, b, conv_state=start.clone(), **meta)
        for cfg in SWEEP:

            def run(state: torch.Tensor, cfg=cfg, x=x, w=w, b=b, meta=meta) -> torch.Tensor:
                return causal_conv1d_varlen_triton(x, w, b, conv_state=state, config=cfg, **meta)

            record_check(f"sweep {name} {cfg}", {"y": rel_err(run(start.clone()), want)})
            ms = bench_ms(lambda run=run, pool=pool: run(pool))
            record_time(f"sweep {name} T={SWEEP_T} {cfg}", ms, floor_ms(2 * SWEEP_T * Cd * 2))


def sweep_update() -> None:
    gen = torch.Generator(device=DEV).manual_seed(4)
    for name, Cd, _ in MODELS:
        w, b = rand(Cd, K, gen=gen), rand(Cd, gen=gen)
        for Bt in UPDATE_BATCHES:
            x, pool = rand(Bt, Cd, gen=gen), rand(Bt + 1, Cd, K - 1, gen=gen)
            slots = torch.randperm(Bt + 1, generator=gen, device=DEV)[:Bt]
            start = pool.clone()
            y_ref = causal_conv1d_update_ref(x, start.clone(), w, b, state_slots=slots)
            floor = floor_ms(Bt * Cd * (2 * 2 + 2 * (K - 1) * 2))
            for cfg in UPDATE_SWEEP:

                def run(state: torch.Tensor, cfg=cfg, x=x, s=slots, w=w, b=b) -> torch.Tensor:
                    return causal_conv1d_update_triton(x, state, w, b, state_slots=s, config=cfg)

                label = f"sweep_update {name} batch={Bt} {cfg or 'default'}"
                record_check(label, {"y": rel_err(run(start.clone()), y_ref)})
                if DEV.type == "cuda":  # timed on `pool`, which each replay writes
                    graph, _ = capture(lambda run=run, pool=pool: run(pool))
                    record_time(label, bench_ms(graph.replay), floor)
                    del graph


def main() -> None:
    environment(OPTS, kernel_width=K, default_config=varlen_launch_config(8448))
    run_sections(
        OPTS,
        dict(
            accuracy=accuracy, varlen=varlen, update=update, sweep=sweep, sweep_update=sweep_update
        ),
    )
    finish(OPTS, "conv1d", "Causal conv1d (varlen prefill and one-token update)")


if __name__ == "__main__":
    main()
