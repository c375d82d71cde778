"""Check and time the fused MoE kernel (Triton) on a GPU, next to its floors.

    PYTHONPATH=$PWD python3 benchmarks/kernels/bench_moe.py --out moe.json

Expert shapes of Jamba-Mini-1.7 (16 experts, top-2, hidden 4096, intermediate 14336) and
Granite-4.0-H-Tiny (64 experts, top-6, hidden 1536, intermediate 512), bf16. Sections,
each guarded so one failure loses no other data: (a) Triton against the float32 PyTorch
twin on the same bf16 inputs, decode and prefill sizes; (b) CUDA-graph capture and
replay (fails on any host sync) against eager, at decode sizes; (c) median times
(triton.testing.do_bench) eager and, for decode, by graph replay, with the twin's time
beside the kernel's at a few sizes; (d) GPU time per launch of one decode call
(torch.profiler); (e) a launch-config sweep at batch 1, 64 and 4096 tokens.
Floors: decode reads only the routed experts' weights, so the byte floor is (distinct
experts hit x one expert's gate/up/down bytes + activations) / 4.23e12 B/s; the FLOP
floor is 2 x tokens x top_k x 3 x hidden x intermediate / 6.85e14 FLOP/s (the H200
figures in docs/kernels_notes.md). `--tiny` runs tiny shapes; without a GPU it needs
TRITON_INTERPRET=1 (set if missing) and only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", default="bench_moe.json", help="path of the JSON results")
ARGS.add_argument("--tiny", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
OPTS = ARGS.parse_args()
if OPTS.tiny and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_common import (  # noqa: E402
    BF16_FLOP_PER_S,
    COPY_BYTES_PER_S,
    RESULTS,
    bench_ms,
    elapsed_s,
    environment,
    finish,
    log,
    record_check,
    rel_err,
    run_sections,
)

from ssmserve.kernels import moe as moe_mod  # noqa: E402
from ssmserve.layers.moe import Routing, select_experts  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (name, experts, top_k, hidden, intermediate)
MODELS = [("jamba-mini-1.7", 16, 2, 4096, 14336), ("granite-4.0-h-tiny", 64, 6, 1536, 512)]
DECODE_T = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_T = [1024, 4096, 8192]
CHECK_T = [1, 16, 256, 2048]
TWIN_T = [1, 256, 4096]
SWEEP_T = [1, 64, 4096]
TIME_BUDGET_S = 240.0
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
SWEEP = [
    (16, 32, 128, 4, 3),
    (16, 64, 64, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 128, 64, 4, 3),
    (16, 64, 256, 8, 3),
    (32, 64, 64, 4, 3),
    (32, 128, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
]
if OPTS.tiny:
    MODELS = [("tiny", 5, 2, 40, 24), ("tiny-top3", 6, 3, 24, 20)]
    DECODE_T, PREFILL_T, CHECK_T, TWIN_T, SWEEP_T = [1, 4], [40], [1, 7], [4], [1, 40]
    SWEEP = SWEEP[:2]


def make_inputs(T: int, E: int, K: int, H: int, I: int, seed: int = 0) -> dict[str, Any]:  # noqa: E741
    """bf16 activations and expert weights at Kaiming-like scales, softmax top-k routing
    from random logits (so loads are uneven, as real routing is)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(torch.bfloat16)

    logits = torch.randn(T, E, generator=gen, device=DEV)
    weights, ids = select_experts(logits, Routing(top_k=K, renormalize=True))
    return dict(
        x=rand(T, H, scale=1.0),
        w13=rand(E, 2 * I, H, scale=H**-0.5),
        w2=rand(E, H, I, scale=I**-0.5),
        weights=weights,
        ids=ids,
    )


def call(fn, inp: dict[str, Any]) -> torch.Tensor:
    return fn(inp["x"], inp["w13"], inp["w2"], inp["weights"], inp["ids"])


def costs(inp: dict[str, Any]) -> dict[str, float]:
    """Bytes read at least once (the experts hit, x) and written (the output), FLOPs."""
    T, H = inp["x"].shape
    E, two_i, _ = inp["w13"].shape
    K = inp["ids"].shape[1]
    hit = int(torch.unique(inp["ids"]).numel())
    expert_bytes = (two_i * H + H * two_i // 2) * 2
    nbytes = hit * expert_bytes + 2 * T * H * 2
    flops = 2 * T * K * 3 * H * (two_i // 2)
    return {
        "experts_hit": hit,
        "bytes": nbytes,
        "flops": flops,
        "floor_mem_ms": nbytes / COPY_BYTES_PER_S * 1e3,
        "floor_flop_ms": flops / BF16_FLOP_PER_S * 1e3,
    }


def record_time(label: str, ms: float, inp: dict[str, Any], **extra: Any) -> None:
    c = costs(inp)
    floor = max(c["floor_mem_ms"], c["floor_flop_ms"])
    row = {"name": label, "ms": ms, "tokens": inp["x"].shape[0], **c, "floor_ms": floor, **extra}
    RESULTS["timings"].append(row)
    log(
        f"time {label:52s} {ms:8.3f} ms  floor {floor:.3f} ms ({ms / floor:.1f}x; "
        f"{c['experts_hit']} experts hit, {c['bytes'] / 1e6:.1f} MB)"
    )


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def check_accuracy() -> None:
    """(a) Triton (bf16) against the twin on float32 copies of the same inputs."""
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in CHECK_T:
            inp = make_inputs(T, E, K, H, I, seed=T)
            ref = {k: (v.float() if v.dtype == torch.bfloat16 else v) for k, v in inp.items()}
            out = call(moe_mod.fused_moe_triton, inp)
            expected = call(moe_mod.fused_moe_ref, ref)
            sync()
            record_check(f"{name} T={T} triton bf16 vs twin fp32", {"y": rel_err(out, expected)})
            del inp, ref


def graph_check_and_time() -> None:
    """(b) + the decode rows of (c): capture one call in a CUDA graph and replay it."""
    if DEV.type != "cuda":
        log("cuda graph: no GPU, skipped")
        return
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in DECODE_T:
            inp = make_inputs(T, E, K, H, I, seed=3)
            eager = call(moe_mod.fused_moe_triton, inp)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call(moe_mod.fused_moe_triton, inp)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call(moe_mod.fused_moe_triton, inp)
            graph.replay()
            torch.cuda.synchronize()
            record_check(f"{name} T={T} graph replay == eager", {"y": rel_err(out, eager)}, 0.0)
            record_time(f"{name} decode T={T} graph replay", bench_ms(graph.replay), inp)
            del graph, inp


def time_sizes() -> None:
    """(c) Eager times at decode and prefill sizes, and the twin's at a few."""
    for name, E, K, H, I in MODELS:  # noqa: E741
        for T in DECODE_T + PREFILL_T:
            inp = make_inputs(T, E, K, H, I)
            ms = bench_ms(lambda inp=inp: call(moe_mod.fused_moe_triton, inp))
            config = moe_mod._launch_config(T * K, E)
            record_time(f"{name} T={T} eager", ms, inp, model=name, config=config)
            if T in TWIN_T:
                ms = bench_ms(lambda inp=inp: call(moe_mod.fused_moe_ref, inp), warmup=3, rep=10)
                record_time(f"{name} T={T} torch twin", ms, inp, model=name)
            del inp


def profile_kernels() -> None:
    """(d) GPU time of each launch in one decode call (routing index work and GEMMs)."""
    if DEV.type != "cuda":
        log("profile: no GPU, skipped")
        return
    from torch.profiler import ProfilerActivity, profile

    for name, E, K, H, I in MODELS:  # noqa: E741
        inp = make_inputs(1, E, K, H, I)
        call(moe_mod.fused_moe_triton, inp)
        torch.cuda.synchronize()
        reps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                call(moe_mod.fused_moe_triton, inp)
            torch.cuda.synchronize()
        totals: dict[str, float] = {}
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                ms = evt.time_range.elapsed_us() / 1e3 / reps
                totals[evt.name] = totals.get(evt.name, 0.0) + ms
        for kernel, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
            RESULTS["kernels"].append({"kernel": kernel, "ms": ms, "case": f"{name} T=1"})
            log(f"kernel {name} {kernel[:60]:60s} {ms:8.4f} ms")


def sweep_configs() -> None:
    """(e) Launch configs at a few sizes, both models."""
    default = moe_mod._launch_config
    try:
        for name, E, K, H, I in MODELS:  # noqa: E741
            for T in SWEEP_T:
                inp = make_inputs(T, E, K, H, I)
                for cfg in SWEEP:
                    if elapsed_s() > TIME_BUDGET_S:
                        log(f"sweep: time budget spent, skipping {cfg}")
                        continue
                    moe_mod._launch_config = lambda *a, cfg=cfg: cfg
                    try:
                        ms = bench_ms(lambda inp=inp: call(moe_mod.fused_moe_triton, inp))
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                        log(f"sweep {cfg}: failed: {str(exc)[:300]}")
                        RESULTS["errors"].append({"section": f"sweep {cfg}", "traceback": str(exc)})
                        continue
                    record_time(f"sweep {name} T={T} {json.dumps(cfg)}", ms, inp, config=cfg)
                del inp
    finally:
        moe_mod._launch_config = default


def main() -> None:
    if DEV.type != "cuda" and not OPTS.tiny:
        raise SystemExit("bench_moe.py needs a CUDA GPU (or --tiny)")
    RESULTS["env"] = environment(tiny=OPTS.tiny, launch_table=moe_mod._LAUNCH_TABLE)
    log(json.dumps(RESULTS["env"], default=str))
    run_sections((check_accuracy, graph_check_and_time, time_sizes, profile_kernels, sweep_configs))
    finish(
        OPTS.out,
        ["case", "ms", "floor ms", "x floor", "experts hit", "MB read"],
        lambda r: [
            r["name"],
            f"{r['ms']:.3f}",
            f"{r['floor_ms']:.3f}",
            f"{r['ms'] / r['floor_ms']:.1f}",
            str(r["experts_hit"]),
            f"{r['bytes'] / 1e6:.1f}",
        ],
    )


if __name__ == "__main__":
    main()
