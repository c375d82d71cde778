"""Check and time paged attention (decode and prefill) on a GPU, next to its floor.

    PYTHONPATH=$PWD python3 benchmarks/kernels/bench_paged_attention.py --out attn.json
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/kernels/bench_paged_attention.py \\
        --tiny --out /tmp/attn.json          # CPU smoke run of every section

Bamba-9B attention dims (32 query heads, 8 KV heads, head_dim 128), bf16, the engine's
16-token KV blocks, block tables shuffled so blocks are scattered. Sections, each guarded
so one failure loses no other data: (a) Triton vs the PyTorch twin run on float32 copies
(ragged decode batch, split long context, mixed prefill + decode, sliding window, fp16);
(b) CUDA-graph capture of a padded decode batch (proves no host sync) against eager;
(c) decode at batch 1 / 64 / 256 x context 1k / 4k / 32k (eager and graph replay), the
same batch through the prefill path for comparison, and prefill cases; (d) and (e)
launch-config sweeps of the decode and prefill paths (--sections picks sections by
function name). Prints a table and writes JSON. Floors are
max(bytes / 4.23e12, FLOP / 6.85e14) (the H200 copy and bf16 matmul rates measured in
docs/kernels_notes.md); decode bytes are the K and V the batch must read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
from collections.abc import Callable
from typing import Any

import torch
from bench_common import (
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

from ssmserve.kernels import paged_attention as attn_mod

MAX_KV_BYTES = 20e9  # skip decode cases whose cache is larger
TIME_BUDGET_S = 50.0

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", default="bench_paged_attention.json", help="JSON results file")
ARGS.add_argument("--tiny", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
ARGS.add_argument("--sections", default="", help="comma-separated section functions to run")
OPTS = ARGS.parse_args()
TINY = OPTS.tiny
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (query heads, KV heads, head_dim, KV block size)
H, KVH, DH, BLOCK_SIZE = (8, 2, 12, 4) if TINY else (32, 8, 128, 16)
BATCHES = (1, 3) if TINY else (1, 64, 256)
CONTEXTS = (20, 70) if TINY else (1024, 4096, 32768)


def leading_decodes(q_lens: list[int]) -> int:
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def make_batch(
    ctx_lens: list[int],
    q_lens: list[int],
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    table_width: int | None = None,
) -> dict[str, Any]:
    """Random q and paged K/V; sequence s holds ctx_lens[s] + q_lens[s] tokens."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = max(max(need), table_width or 0)
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=DEV).to(torch.int32)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEV)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[at : at + n]
        at += n
    shape = (num_blocks, BLOCK_SIZE, KVH, DH)
    qsl = torch.tensor([0, *q_lens], device=DEV).cumsum(0).to(torch.int32)
    return dict(
        q=torch.randn(sum(q_lens), H, DH, generator=gen, device=DEV).to(dtype),
        k_cache=torch.randn(shape, generator=gen, device=DEV).to(dtype),
        v_cache=torch.randn(shape, generator=gen, device=DEV).to(dtype),
        block_tables=tables,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        num_decodes=leading_decodes(q_lens),
        ctx_lens=ctx_lens,
        q_lens=q_lens,
    )


def call(
    fn: Callable[..., torch.Tensor],
    b: dict[str, Any],
    num_decodes: int | None = None,
    sliding_window: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """fn on batch b; num_decodes defaults to the batch's leading one-query sequences."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    return fn(
        cast(b["q"]),
        cast(b["k_cache"]),
        cast(b["v_cache"]),
        block_tables=b["block_tables"],
        query_start_loc=b["query_start_loc"],
        seq_lens=b["seq_lens"],
        scale=DH**-0.5,
        sliding_window=sliding_window,
        num_decodes=b["num_decodes"] if num_decodes is None else num_decodes,
    )


def costs(ctx_lens: list[int], q_lens: list[int], elem: int = 2) -> dict[str, float]:
    """Bytes (K/V read once per KV head, q read, out written) and causal FLOP."""
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    T = sum(q_lens)
    kv_bytes = 2 * sum(seq_lens) * KVH * DH * elem
    nbytes = kv_bytes + 2 * T * H * DH * elem
    keys_seen = sum(q * c + q * (q + 1) // 2 for c, q in zip(ctx_lens, q_lens, strict=True))
    flops = 4 * keys_seen * H * DH
    return {
        "bytes": nbytes,
        "flops": flops,
        "floor_ms": max(nbytes / COPY_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e3,
    }


def timed_ms(fn: Callable[[], Any]) -> float:
    return bench_ms(fn, warmup=10, rep=40)


def record_time(label: str, ms: float, b: dict[str, Any], **extra: Any) -> None:
    c = costs(b["ctx_lens"], b["q_lens"])
    row = {
        "name": label,
        "ms": ms,
        "seqs": len(b["q_lens"]),
        "tokens": sum(b["q_lens"]),
        **c,
        **extra,
    }
    RESULTS["timings"].append(row)
    log(
        f"time {label:58s} {ms:8.3f} ms  floor {c['floor_ms']:.3f}  "
        f"({ms / c['floor_ms']:.1f}x floor)"
    )


def over_budget(what: str) -> bool:
    if elapsed_s() > TIME_BUDGET_S:
        log(f"time budget spent, skipping {what}")
        return True
    return False


def check_accuracy() -> None:
    """(a) Triton against the twin on float32 copies of the same inputs."""
    gen = torch.Generator().manual_seed(1)
    long_ctx = 300 if TINY else 32768 - 1
    mid = 60 if TINY else 4096
    ragged = [0, BLOCK_SIZE - 1, BLOCK_SIZE, long_ctx // 7] + torch.randint(
        1, mid, (5 if TINY else 60,), generator=gen
    ).tolist()
    prefill_ctx, prefill_q = ([0, 9, 30], [7, 20, 5]) if TINY else ([0, 1000, 3000], [777, 500, 64])
    cases = [
        ("decode ragged", ragged, [1] * len(ragged), None, torch.bfloat16),
        ("decode 1 seq long (split)", [long_ctx], [1], None, torch.bfloat16),
        ("decode ragged fp16", ragged, [1] * len(ragged), None, torch.float16),
        (
            "decode ragged window 1000",
            ragged,
            [1] * len(ragged),
            13 if TINY else 1000,
            torch.bfloat16,
        ),
        (
            "mixed decode + prefill",
            ragged[:8] + prefill_ctx,
            [1] * 8 + prefill_q,
            None,
            torch.bfloat16,
        ),
        (
            "mixed window 1000",
            ragged[:8] + prefill_ctx,
            [1] * 8 + prefill_q,
            13 if TINY else 1000,
            torch.bfloat16,
        ),
    ]
    for name, ctx, q_lens, window, dtype in cases:
        b = make_batch(ctx, q_lens, seed=len(ctx))
        ref = call(attn_mod.paged_attention_ref, b, sliding_window=window, dtype=torch.float32)
        out = call(attn_mod.paged_attention_triton, b, sliding_window=window, dtype=dtype)
        errors = {"num_decodes set": rel_err(out, ref)}
        if leading_decodes(q_lens) > 0:
            general = call(
                attn_mod.paged_attention_triton,
                b,
                num_decodes=0,
                sliding_window=window,
                dtype=dtype,
            )
            errors["all via prefill path"] = rel_err(general, ref)
        record_check(f"{name} ({len(ctx)} seqs)", errors)
        del b


def check_cuda_graph() -> None:
    """(b) A padded decode batch as DecodeGraphs builds it, captured and replayed."""
    if DEV.type != "cuda":
        log("cuda graph: skipped (no GPU)")
        return
    n, size, width = 50, 64, -(-32768 // BLOCK_SIZE)
    ctx = torch.randint(1, 4096, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    real = make_batch(ctx, [1] * n, table_width=width)
    pad = size - n
    padded = dict(real)
    padded["q"] = torch.cat([real["q"], torch.randn(pad, H, DH, device=DEV).to(real["q"].dtype)])
    padded["block_tables"] = torch.cat([real["block_tables"], real["block_tables"][:pad]])
    padded["query_start_loc"] = torch.arange(size + 1, dtype=torch.int32, device=DEV)
    padded["seq_lens"] = torch.cat(
        [real["seq_lens"], torch.ones(pad, dtype=torch.int32, device=DEV)]
    )
    padded["num_decodes"] = size
    padded["ctx_lens"], padded["q_lens"] = ctx + [0] * pad, [1] * size
    eager = call(attn_mod.paged_attention_triton, padded)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(attn_mod.paged_attention_triton, padded)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(attn_mod.paged_attention_triton, padded)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref = call(attn_mod.paged_attention_ref, real, dtype=torch.float32)
    record_check(
        f"graph replay == eager, batch {n} padded to {size}, 32k-token tables",
        {"replay vs eager": rel_err(out, eager), "real rows vs twin": rel_err(out[:n], ref)},
        limit=1e-2,
    )
    ok = bool(torch.isfinite(out[n:].float()).all())
    record_check("padding rows finite", {"nonfinite": 0.0 if ok else math.inf})
    record_time(
        f"decode batch {n}->{size} ctx<4k, 32k tables, graph", timed_ms(graph.replay), padded
    )


def graph_ms(fn: Callable[[], Any]) -> float | None:
    """Time one call replayed from a CUDA graph (how the engine runs decode)."""
    if DEV.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = timed_ms(graph.replay)
    del graph
    return ms


def time_decode() -> None:
    """(c) Decode at each batch x context, eager and graph; prefill path for comparison."""
    for batch in BATCHES:
        for ctx in CONTEXTS:
            kv_bytes = 2 * batch * ctx * KVH * DH * 2
            if kv_bytes > MAX_KV_BYTES:
                log(f"decode batch {batch} ctx {ctx}: skipped ({kv_bytes / 1e9:.0f} GB of KV)")
                continue
            if over_budget(f"decode batch {batch} ctx {ctx}"):
                continue
            b = make_batch([ctx - 1] * batch, [1] * batch)
            fn = lambda b=b: call(attn_mod.paged_attention_triton, b)  # noqa: E731
            cfg = attn_mod._decode_config(batch, KVH, H // KVH, DH, ctx, DEV)
            record_time(f"decode batch {batch} ctx {ctx}", timed_ms(fn), b, config=cfg)
            ms = graph_ms(fn)
            if ms is not None:
                record_time(f"decode batch {batch} ctx {ctx} graph", ms, b, config=cfg)
            if batch == BATCHES[1] and ctx == CONTEXTS[1]:
                general = lambda b=b: call(attn_mod.paged_attention_triton, b, 0)  # noqa: E731
                record_time(
                    f"decode batch {batch} ctx {ctx} via prefill path", timed_ms(general), b
                )
            del b


def time_prefill() -> None:
    """(c) Prefill regression cases: fresh prompts and a chunk over a long cached context."""
    cases = (
        [
            ("4 x 2k prompts", [0] * 4, [2048] * 4),
            ("2k chunk over 30k context", [30720], [2048]),
            ("8k chunk over 24k context", [24576], [8192]),
            ("mixed 32 decodes 4k + 1k chunk", [4095] * 32 + [3072], [1] * 32 + [1024]),
        ]
        if not TINY
        else [("2 prompts", [0, 10], [23, 17]), ("mixed", [40, 30, 9], [1, 1, 20])]
    )
    for name, ctx, q_lens in cases:
        if over_budget(name):
            continue
        b = make_batch(ctx, q_lens)
        record_time(
            f"prefill {name}",
            timed_ms(lambda b=b: call(attn_mod.paged_attention_triton, b)),
            b,
            config=attn_mod._prefill_config(H // KVH, DH),
        )
        del b


def sweep_point(
    label: str, b: dict[str, Any], expected: torch.Tensor, cfg: dict[str, Any], graphed: bool
) -> None:
    """Time the patched-in launch config `cfg` on batch b (under graph replay if `graphed`
    and it captures), checked against the default config's output `expected`."""
    fn = lambda: call(attn_mod.paged_attention_triton, b)  # noqa: E731
    try:
        err = rel_err(fn(), expected)
        ms = graph_ms(fn) if graphed else None
        if ms is None:
            ms = timed_ms(fn)
    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
        log(f"{label}: failed: {str(exc)[:300]}")
        RESULTS["errors"].append({"section": label, "traceback": str(exc)[:3000]})
        return
    record_time(label, ms, b, config=cfg, rel_err_vs_default=err)
    if err > 1e-2:
        record_check(label, {"vs default config": err})


def sweep_decode() -> None:
    """(d) Decode launch configs (block_n, warps, stages, splits), each checked against
    the default config's output."""
    points = [(64, 4096), (8, 4096), (1, 32768)] if not TINY else [(3, 70)]
    variants = [
        {},
        {"num_stages": 2},
        {"num_stages": 1},
        {"num_warps": 8},
        {"block_n": 32},
        {"block_n": 32, "num_stages": 2},
        {"block_n": 128, "num_warps": 8},
        {"splits": 0.5},
        {"splits": 2},
    ]
    default = attn_mod._decode_config
    try:
        for batch, ctx in points:
            b = make_batch([ctx - 1] * batch, [1] * batch)
            expected = call(attn_mod.paged_attention_triton, b)
            for override in variants:
                if over_budget(f"sweep batch {batch} ctx {ctx} {override}"):
                    continue
                cfg = dict(default(batch, KVH, H // KVH, DH, ctx, DEV))
                cfg.update({k: v for k, v in override.items() if k != "splits"})
                if "splits" in override:
                    cfg["num_splits"] = max(1, min(64, int(cfg["num_splits"] * override["splits"])))
                attn_mod._decode_config = lambda *a, cfg=cfg, **k: cfg
                label = f"sweep batch {batch} ctx {ctx} " + json.dumps(override)
                sweep_point(label, b, expected, cfg, graphed=True)
            del b
    finally:
        attn_mod._decode_config = default


def sweep_prefill() -> None:
    """(e) Prefill launch configs (rows, key tile, warps, stages), each checked against the
    default config's output."""
    cases = (
        [
            ("2k chunk over 30k context", [30720], [2048]),
            ("8k chunk over 24k context", [24576], [8192]),
        ]
        if not TINY
        else [("mixed", [40, 30, 9], [1, 1, 20])]
    )
    variants = [
        {},
        {"block_n": 64},
        {"block_n": 64, "num_warps": 8},
        {"block_m": 128},
        {"block_m": 128, "num_warps": 8},
        {"block_m": 128, "block_n": 64, "num_warps": 8},
        {"num_stages": 3},
        {"block_n": 64, "num_stages": 3},
        {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    ]
    default = attn_mod._prefill_config
    try:
        for name, ctx, q_lens in cases:
            b = make_batch(ctx, q_lens)
            expected = call(attn_mod.paged_attention_triton, b)
            for override in variants:
                label = f"sweep prefill {name} " + json.dumps(override)
                if over_budget(label):
                    continue
                cfg = {**default(H // KVH, DH), **override}
                cfg["block_q"] = cfg["block_m"] // (H // KVH)
                attn_mod._prefill_config = lambda *a, cfg=cfg, **k: cfg
                sweep_point(label, b, expected, cfg, graphed=False)
            del b
    finally:
        attn_mod._prefill_config = default


def main() -> None:
    if DEV.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA GPU: run with --tiny and TRITON_INTERPRET=1 for a CPU check")
    if DEV.type != "cuda" and not TINY:
        raise SystemExit("the interpreter is far too slow for real sizes; add --tiny")
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "ssmserve/kernels"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    RESULTS["env"] = environment(
        kernels_dirty=bool(dirty), dims={"H": H, "KVH": KVH, "Dh": DH, "block_size": BLOCK_SIZE}
    )
    log(json.dumps(RESULTS["env"]))
    sections = (
        check_accuracy,
        check_cuda_graph,
        time_decode,
        time_prefill,
        sweep_decode,
        sweep_prefill,
    )
    run_sections([s for s in sections if not OPTS.sections or s.__name__ in OPTS.sections])
    finish(
        OPTS.out,
        ["case", "ms", "floor ms", "x floor"],
        lambda r: [
            r["name"],
            f"{r['ms']:.4f}",
            f"{r['floor_ms']:.4f}",
            f"{r['ms'] / r['floor_ms']:.2f}",
        ],
    )


if __name__ == "__main__":
    main()
