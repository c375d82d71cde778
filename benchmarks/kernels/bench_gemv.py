"""How fast is the Triton GEMV next to F.linear (cuBLAS) at decode sizes, and next to the
floor of reading each weight once?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_gemv.py          # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_gemv.py --tiny   # CPU smoke run

The linear layers' shapes of the models in benchmarks/configs/{bamba-9b, llama-3-8b,
mamba2-2.7b, mamba-2.8b} (from each config.json: Mamba in_proj / x_proj / dt_proj /
out_proj, attention qkv / o, MLP gate_up / down, LM head), one row per distinct (N, K),
bf16, at M = 1, 2 and 4 rows. Sections:
- accuracy: the GEMV and F.linear on the same bf16 inputs against F.linear in float32
  (max abs and relative L2 error, the cuBLAS error beside it), and float32 inputs.
- sizes: F.linear and the GEMV at its default launch parameters and at the best of a
  small sweep (`config=`), each timed as GRAPH_CALLS calls under one CUDA-graph replay
  (how the engine decodes: no launch overhead). Successive calls rotate over copies of
  the weight, at least ROTATE_BYTES of them, so a weight that fits in L2 is read from
  HBM, as successive layers read theirs.
Floor: the weight, x and the output read or written once at the copy rate; "% BW" is
floor / time.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import (
    COPY_BYTES_PER_S,
    DEV,
    RESULTS,
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

from ssmserve.kernels.gemv import gemv_launch_config, gemv_triton

SECTIONS = ("accuracy", "sizes")


def _extra_args(parser) -> None:
    parser.add_argument(
        "--list-shapes",
        action="store_true",
        help="print the models' (layers, N, K) as JSON and exit (no kernel runs)",
    )


OPTS = parse_args(__doc__, SECTIONS, _extra_args)
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")
MODELS = ("bamba-9b", "llama-3-8b", "mamba2-2.7b", "mamba-2.8b")
ROWS = (1, 2, 4)
GRAPH_CALLS = 20
ROTATE_BYTES = 256 << 20
DTYPE = torch.bfloat16
SWEEP: list[dict[str, Any]] = [
    {"block_n": 16},
    {"block_n": 32},
    {"block_n": 64},
    {"block_n": 128, "num_warps": 8},
    {"block_k": 64},
    {"block_k": 256},
    {"num_warps": 2},
    {"num_warps": 8},
    {"num_stages": 2},
    {"num_stages": 3},
    {"num_stages": 6},
    {"split_k": 1},
    {"split_k": 2},
    {"split_k": 4},
    {"split_k": 8},
]
if OPTS.tiny:
    ROWS, GRAPH_CALLS, ROTATE_BYTES = (1, 2), 2, 0
    SWEEP = [{"block_n": 16, "block_k": 16}, {"split_k": 2, "block_k": 16}]


def model_shapes(name: str) -> list[tuple[str, int, int]]:
    """(layer, N, K) of the linears of one decoder layer of each kind, and the LM head."""
    with open(os.path.join(CONFIGS, name, "config.json")) as f:
        cfg = json.load(f)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    shapes = []
    if cfg["model_type"] == "mamba":
        inner, rank, state = cfg["intermediate_size"], cfg["time_step_rank"], cfg["state_size"]
        shapes += [
            ("in_proj", 2 * inner, hidden),
            ("x_proj", rank + 2 * state, inner),
            ("dt_proj", inner, rank),
            ("out_proj", hidden, inner),
        ]
    elif cfg["model_type"] == "mamba2":
        heads, inner = cfg["num_heads"], cfg["num_heads"] * cfg["head_dim"]
        bc = 2 * cfg["n_groups"] * cfg["state_size"]
        shapes += [("in_proj", 2 * inner + bc + heads, hidden), ("out_proj", hidden, inner)]
    if cfg["model_type"] == "bamba":
        heads, inner = cfg["mamba_n_heads"], cfg["mamba_n_heads"] * cfg["mamba_d_head"]
        bc = 2 * cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        shapes += [("in_proj", 2 * inner + bc + heads, hidden), ("out_proj", hidden, inner)]
    if cfg["model_type"] in ("bamba", "llama"):
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        shapes += [
            ("qkv_proj", (heads + 2 * kv) * head_dim, hidden),
            ("o_proj", hidden, heads * head_dim),
            ("gate_up_proj", 2 * cfg["intermediate_size"], hidden),
            ("down_proj", hidden, cfg["intermediate_size"]),
        ]
    return [*shapes, ("lm_head", vocab, hidden)]


def distinct_shapes(real: bool = False) -> list[tuple[str, int, int]]:
    """(models and layers, N, K), one per distinct (N, K), in first-seen order; with --tiny
    (and not `real`) small stand-ins."""
    if OPTS.tiny and not real:
        return [("tiny in_proj", 48, 80), ("tiny x_proj", 20, 100), ("tiny lm_head", 70, 32)]
    names: dict[tuple[int, int], list[str]] = {}
    for model in MODELS:
        for layer, N, K in model_shapes(model):
            names.setdefault((N, K), []).append(f"{model} {layer}")
    return [(", ".join(n), N, K) for (N, K), n in names.items()]


def make_inputs(M: int, N: int, K: int, dtype: torch.dtype, copies: int = 1, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=gen, device=DEV).to(dtype)
    weights = [
        (torch.randn(N, K, generator=gen, device=DEV) * K**-0.5).to(dtype) for _ in range(copies)
    ]
    return x, weights


def nbytes(M: int, N: int, K: int, elem: int) -> int:
    return (N * K + M * K + M * N) * elem


def accuracy() -> None:
    for label, N, K in distinct_shapes():
        for dtype in (DTYPE, torch.float32):
            x, (w,) = make_inputs(max(ROWS), N, K, dtype)
            truth = F.linear(x.float(), w.float())
            got, cublas = gemv_triton(x, w), F.linear(x, w)
            errors = {"gemv": rel_err(got, truth), "F.linear": rel_err(cublas, truth)}
            limit = 1e-2 if dtype == DTYPE else 1e-5
            record_check(f"{label} N={N} K={K} M={max(ROWS)} {dtype}", errors, limit)
            RESULTS["checks"][-1]["max_abs"] = {
                "gemv": float((got.float() - truth).abs().max()),
                "F.linear": float((cublas.float() - truth).abs().max()),
            }


def graph_ms(fn_of_weight, weights: list[torch.Tensor]) -> float:
    """ms per call: GRAPH_CALLS calls over the rotated weights under one graph replay (on
    a GPU), else one eager call's wall time (the interpreter: only proves the path)."""
    if DEV.type != "cuda":
        return bench_ms(lambda: fn_of_weight(weights[0]))
    graph, _ = capture(
        lambda: [fn_of_weight(weights[i % len(weights)]) for i in range(GRAPH_CALLS)]
    )
    ms = bench_ms(graph.replay) / GRAPH_CALLS
    del graph
    return ms


def sizes() -> None:
    table = []
    for label, N, K in distinct_shapes():
        elem = torch.empty((), dtype=DTYPE).element_size()
        copies = max(1, min(32, math.ceil(ROTATE_BYTES / (N * K * elem))))
        for M in ROWS:
            x, weights = make_inputs(M, N, K, DTYPE, copies)
            floor = floor_ms(nbytes(M, N, K, elem))
            name = f"{label} N={N} K={K} M={M}"
            cublas = graph_ms(lambda w, x=x: F.linear(x, w), weights)
            record_time(f"{name} F.linear", cublas, floor)
            default = gemv_launch_config(N, K, M, DTYPE, DEV)
            sweep = []
            for override in [{}, *SWEEP]:
                cfg = gemv_launch_config(N, K, M, DTYPE, DEV, override)
                if override and cfg == default:
                    continue
                ms = graph_ms(lambda w, x=x, cfg=cfg: gemv_triton(x, w, config=cfg), weights)
                sweep.append({"config": cfg, "ms": ms})
            RESULTS.setdefault("sweep", []).append({"case": name, "rows": sweep})
            best = min(sweep, key=lambda r: r["ms"])
            record_time(f"{name} gemv default", sweep[0]["ms"], floor, config=default)
            record_time(f"{name} gemv best", best["ms"], floor, config=best["config"])
            table.append((label, N, K, M, floor, cublas, sweep[0]["ms"], best))
            del x, weights
    lines = [
        "| layers | N | K | M | floor us | F.linear us | % BW | gemv default us | % BW "
        "| gemv best us | % BW | best config |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, N, K, M, floor, cublas, default_ms, best in table:
        cfg = best["config"]
        pretty = (
            f"{cfg['block_n']}x{cfg['block_k']} split {cfg['split_k']}, "
            f"{cfg['num_warps']}w {cfg['num_stages']}s"
        )
        lines.append(
            f"| {label} | {N} | {K} | {M} | {floor * 1e3:.2f} | {cublas * 1e3:.2f} | "
            f"{100 * floor / cublas:.0f} | {default_ms * 1e3:.2f} | "
            f"{100 * floor / default_ms:.0f} | {best['ms'] * 1e3:.2f} | "
            f"{100 * floor / best['ms']:.0f} | {pretty} |"
        )
    RESULTS["summary_md"] = lines
    log("\n".join(lines))


def main() -> None:
    if OPTS.list_shapes:
        log(json.dumps(distinct_shapes(real=True)))
        return
    environment(
        OPTS,
        dtype=str(DTYPE),
        rows=ROWS,
        graph_calls=GRAPH_CALLS,
        rotate_bytes=ROTATE_BYTES,
        floor_rate_bytes_per_s=COPY_BYTES_PER_S,
    )
    run_sections(OPTS, dict(accuracy=accuracy, sizes=sizes))
    finish(OPTS, "gemv", "Triton GEMV against F.linear at decode sizes")


if __name__ == "__main__":
    main()
