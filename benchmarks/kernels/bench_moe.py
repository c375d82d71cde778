"""How fast are the fused expert MLPs (mixture of experts), next to the floor of reading
only the routed experts' weights?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_moe.py          # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_moe.py --tiny   # CPU smoke run

Expert shapes of Jamba-Mini-1.7 (16 experts, top-2, hidden 4096, intermediate 14336) and
Granite-4.0-H-Tiny (64 experts, top-6, hidden 1536, intermediate 512), bf16, softmax
top-k routing from random logits (uneven loads, as real routing has). Sections:
- accuracy: Triton against the float32 twin on the same bf16 inputs, decode and prefill.
- graphs: CUDA-graph capture (fails on any host sync) and replay equal to eager, and the
  decode sizes timed by replay (how the engine decodes: no launch overhead), and the
  router's top-k, Triton against PyTorch's ops.
- sizes: eager times at decode and prefill sizes, the twin's beside them at a few.
- profile: GPU time per launch of one batch-1 call (routing index work and the GEMMs).
- sweep: launch parameters (`config=`) at 1, 64, 256 and 4096 tokens.
Floor: max(bytes / copy rate, FLOP / bf16 rate), where the bytes are the gate/up/down
weights of the distinct experts the batch routes to (each read once) plus the
activations, and the FLOPs 2 x tokens x top_k x 3 x hidden x intermediate.
"""

from __future__ import annotations

from typing import Any

import torch
from bench_common import (
    DEV,
    RESULTS,
    bench_ms,
    capture,
    environment,
    finish,
    floor_ms,
    log,
    parse_args,
    profile_ms,
    record_check,
    record_time,
    rel_err,
    run_sections,
)

from ssmserve.kernels.moe import (
    fused_moe_ref,
    fused_moe_triton,
    moe_launch_config,
    moe_route_ref,
    moe_route_triton,
)
from ssmserve.layers.moe import Routing, select_experts

SECTIONS = ("accuracy", "graphs", "sizes", "profile", "sweep")
OPTS = parse_args(__doc__, SECTIONS)
# (name, experts, top_k, hidden, intermediate)
MODELS = [("jamba-mini-1.7", 16, 2, 4096, 14336), ("granite-4.0-h-tiny", 64, 6, 1536, 512)]
DECODE_T = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_T = [1024, 4096, 8192]
CHECK_T = [1, 16, 256, 2048]
TWIN_T = [1, 256, 4096]
SWEEP_T = [1, 64, 256, 4096]
SWEEP = [
    {"block_m": 16, "block_n": 32, "block_k": 128},
    {"block_m": 16, "block_n": 64, "block_k": 64, "num_stages": 4},
    {"block_m": 16, "block_n": 128, "block_k": 64},
    {"block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 8},
    {"block_m": 32, "block_n": 64, "block_k": 64},
    {"block_m": 32, "block_n": 128, "block_k": 64},
    {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 8},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8},
    {"block_m": 64, "block_n": 256, "block_k": 64, "num_warps": 8},
]
if OPTS.tiny:
    MODELS = [("tiny", 5, 2, 40, 24), ("tiny-top3", 6, 3, 24, 20)]
    DECODE_T, PREFILL_T, CHECK_T, TWIN_T, SWEEP_T = [1, 4], [40], [1, 7], [4], [1, 40]
    SWEEP = SWEEP[:2]


def make_inputs(T: int, E: int, K: int, H: int, I: int, seed: int = 0) -> dict[str, Any]:  # noqa: E741
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(torch.bfloat16)

    logits = torch.randn(T, E, generator=gen, device=DEV)
    weights, ids = select_experts(logits, Routing(top_k=K, renormalize=True))
    return dict(
        x=rand(T, H, scale=1.0),
        w13=rand(E, 2 * I, H, scale=H**-0.5),
        w2=rand(E, H, I, scale=I**-0.5),
        topk_weights=weights,
        topk_ids=ids,
    )


def floor(inp: dict[str, Any]) -> tuple[float, int]:
    """The floor (ms) and the number of distinct experts the batch routes to."""
    T, H = inp["x"].shape
    two_i = inp["w13"].shape[1]
    K = inp["topk_ids"].shape[1]
    hit = int(torch.unique(inp["topk_ids"]).numel())
    nbytes = hit * (two_i * H + H * two_i // 2) * 2 + 2 * T * H * 2
    return floor_ms(nbytes, 2 * T * K * 3 * H * (two_i // 2)), hit


def timed(label: str, fn, inp: dict[str, Any], **extra: Any) -> None:
    ms_floor, hit = floor(inp)
    record_time(label, bench_ms(fn), ms_floor, experts_hit=hit, **extra)


def accuracy() -> None:
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in CHECK_T:
            inp = make_inputs(T, E, K, H, I, seed=T)
            ref = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in inp.items()}
            errors = {"y": rel_err(fused_moe_triton(**inp), fused_moe_ref(**ref))}
            record_check(f"{name} T={T} bf16 kernel vs float32 twin", errors)
            del inp, ref


def graphs() -> None:
    if DEV.type != "cuda":
        log("graphs: no GPU, skipped")
        return
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in DECODE_T:
            inp = make_inputs(T, E, K, H, I, seed=3)
            eager = fused_moe_triton(**inp)
            graph, out = capture(lambda inp=inp: fused_moe_triton(**inp))
            graph.replay()
            torch.cuda.synchronize()
            record_check(f"{name} T={T} graph replay == eager", {"y": rel_err(out, eager)}, 0.0)
            timed(f"{name} T={T} graph replay", graph.replay, inp)
            logits = torch.randn(T, E, device=DEV)
            for label, route in (("triton", moe_route_triton), ("torch", moe_route_ref)):
                g, _ = capture(lambda fn=route, lg=logits, k=K: fn(lg, top_k=k, renormalize=True))
                ms_floor = floor_ms(T * E * 4 + T * K * 12, 0)
                record_time(
                    f"{name} T={T} router top-k ({label}) graph replay",
                    bench_ms(g.replay),
                    ms_floor,
                )
                del g
            del graph, inp


def sizes() -> None:
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in DECODE_T + PREFILL_T:
            inp = make_inputs(T, E, K, H, I)
            cfg = moe_launch_config(T * K, E, intermediate=I)
            timed(f"{name} T={T} eager", lambda inp=inp: fused_moe_triton(**inp), inp, config=cfg)
            if T in TWIN_T:
                timed(f"{name} T={T} torch twin", lambda inp=inp: fused_moe_ref(**inp), inp)
            del inp


def profile() -> None:
    for name, E, K, H, I in MODELS:  # noqa: E741
        inp = make_inputs(1, E, K, H, I)
        profile_ms(lambda inp=inp: fused_moe_triton(**inp), f"{name} T=1", reps=10)


def sweep() -> None:
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in SWEEP_T:
            inp = make_inputs(T, E, K, H, I)
            for override in SWEEP:
                cfg = moe_launch_config(T * K, E, override, I)
                label = f"sweep {name} T={T} {override}"
                try:
                    fn = lambda inp=inp, cfg=cfg: fused_moe_triton(**inp, config=cfg)  # noqa: E731
                    timed(label, fn, inp, config=cfg)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    log(f"{label}: failed: {str(exc)[:300]}")
                    RESULTS["errors"].append({"section": label, "traceback": str(exc)})
            del inp


def main() -> None:
    environment(OPTS, default_config_decode=moe_launch_config(2, 16))
    named = dict(accuracy=accuracy, graphs=graphs, sizes=sizes, profile=profile, sweep=sweep)
    run_sections(OPTS, named)
    finish(OPTS, "moe", "Fused MoE expert MLPs")


if __name__ == "__main__":
    main()
