"""Check and time the ssmserve kernels on a GPU; print each time next to its floor.

    PYTHONPATH=. python3 benchmarks/kernels/bench_kernels.py --out DIR

One run does everything (device time is scarce): (a) Triton vs PyTorch twin at
real sizes, (b) the card's copy bandwidth and bf16 matmul rate, (c) kernel times
(median of triton.testing.do_bench) at Bamba-9B and Mamba2-2.7B mixer dims, and
a sweep of launch configs for the state update (the SSD sweep lives in bench_ssd.py). Writes
kernels_<date>.json and .md into --out. `--smoke` runs tiny sizes on CPU under the
Triton interpreter to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--out", default=".")
ARGS.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (interpreter)")
ARGS.add_argument("--only", default="", help="comma list of sections to run")
OPTS = ARGS.parse_args()
if OPTS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"

from bench_common import RESULTS, guarded, log, record_check, rel_err  # noqa: E402

from ssmserve.kernels import causal_conv1d as conv_mod  # noqa: E402
from ssmserve.kernels import gated_rms_norm as norm_mod  # noqa: E402
from ssmserve.kernels import paged_attention as attn_mod  # noqa: E402
from ssmserve.kernels import selective_scan as sel_mod  # noqa: E402
from ssmserve.kernels import ssd_scan as ssd_mod  # noqa: E402
from ssmserve.kernels import state_update as su_mod  # noqa: E402

DEV = torch.device("cpu" if OPTS.smoke else "cuda")
RESULTS["ceilings"] = {}
# Model dims: (name, heads, head_dim, d_state, n_groups, conv_dim)
MODELS = [
    ("bamba-9b", 128, 64, 128, 1, 8192 + 2 * 128),
    ("mamba2-2.7b", 80, 64, 128, 1, 5120 + 2 * 128),
]
if OPTS.smoke:
    MODELS = [("smoke", 4, 16, 16, 1, 48)]


def section(name: str) -> bool:
    return not OPTS.only or name in OPTS.only.split(",")


def bench(fn: Callable[[], Any]) -> float:
    """Median milliseconds."""
    if OPTS.smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def floor_ms(bytes_moved: float, flops: float) -> tuple[float, float]:
    c = RESULTS["ceilings"]
    return bytes_moved / c["copy_bytes_per_s"] * 1e3, flops / c["bf16_flop_per_s"] * 1e3


def record_time(name: str, ms: float, bytes_moved: float, flops: float, **extra: Any) -> None:
    mem_ms, flop_ms = floor_ms(bytes_moved, flops)
    floor = max(mem_ms, flop_ms)
    RESULTS["timings"].append(
        {
            "name": name,
            "ms": ms,
            "floor_ms": floor,
            "mem_floor_ms": mem_ms,
            "flop_floor_ms": flop_ms,
            "bytes": bytes_moved,
            "flops": flops,
            **extra,
        }
    )
    log(
        f"time {name:<58} {ms * 1e3:10.1f} us   floor {floor * 1e3:9.1f} us "
        f"({'mem' if mem_ms >= flop_ms else 'flop'})  x{ms / floor:5.2f}"
    )


def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ----------------------------------------------------------------------------- ceilings


def ceilings() -> None:
    if OPTS.smoke:
        RESULTS["ceilings"] = {"copy_bytes_per_s": 1e10, "bf16_flop_per_s": 1e11}
        return
    n = 1 << 29  # 1 GiB of bf16 per buffer: far beyond L2
    bufs = [randn(n), torch.empty(n, dtype=torch.bfloat16, device=DEV)]
    ms = bench(lambda: bufs[1].copy_(bufs[0]))
    copy = 2 * n * 2 / (ms * 1e-3)
    bufs.clear()
    m = 8192
    a, b = randn(m, m), randn(m, m)
    ms_mm = bench(lambda: a @ b)
    rate = 2 * m**3 / (ms_mm * 1e-3)
    RESULTS["ceilings"] = {"copy_bytes_per_s": copy, "bf16_flop_per_s": rate}
    log(
        f"ceilings: copy {copy / 1e12:.2f} TB/s (read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )


# ----------------------------------------------------------------------------- SSD scan


def ssd_inputs(T: int, H: int, P: int, N: int, G: int, lengths: list[int], init: bool):
    S = len(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return dict(
        x=randn(T, H, P),
        dt=randn(T, H, scale=0.5),
        A=-torch.exp(randn(H, dtype=torch.float32)),
        B=randn(T, G, N),
        C=randn(T, G, N),
        D=randn(H, dtype=torch.float32),
        dt_bias=randn(H, dtype=torch.float32, scale=0.5) - 2.0,
        cu_seqlens=cu.to(DEV),
        ssm_state=randn(S + 2, H, P, N, dtype=torch.float32, scale=0.1),
        state_slots=torch.arange(S, dtype=torch.int32, device=DEV) + 1,
        has_initial_state=torch.full((S,), init, device=DEV),
    )


def call_ssd(fn: Callable[..., torch.Tensor], inp: dict[str, Any], **kw: Any) -> torch.Tensor:
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
        **kw,
    )


def check_ssd() -> None:
    for name, H, P, N, G, _ in MODELS:
        T = 256 if OPTS.smoke else 4096
        for lengths, init in (([T], False), ([T // 4 - 37, 1, T // 2 + 36, T // 4], True)):
            inp = ssd_inputs(T, H, P, N, G, lengths, init)
            pool = inp["ssm_state"].clone()
            y_ref = call_ssd(ssd_mod.ssd_scan_varlen_ref, inp)
            state_ref = inp["ssm_state"].clone()
            inp["ssm_state"] = pool
            y = call_ssd(ssd_mod.ssd_scan_varlen_triton, inp)
            record_check(
                f"ssd {name} T={T} seqs={len(lengths)} init={init}",
                {"y": rel_err(y, y_ref), "state": rel_err(pool, state_ref)},
                1e-2,
            )
        # resumed mid-chunk equals whole, on the GPU kernel
        inp = ssd_inputs(T, H, P, N, G, [T], False)
        y_whole = call_ssd(ssd_mod.ssd_scan_varlen_triton, inp)
        state_whole = inp["ssm_state"][1].clone()
        split = T // 2 + 29
        first = {k: (v[:split] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
        second = {k: (v[split:] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
        first["cu_seqlens"] = torch.tensor([0, split], dtype=torch.int32, device=DEV)
        second["cu_seqlens"] = torch.tensor([0, T - split], dtype=torch.int32, device=DEV)
        y1 = call_ssd(ssd_mod.ssd_scan_varlen_triton, first)
        second["has_initial_state"] = torch.ones(1, dtype=torch.bool, device=DEV)
        y2 = call_ssd(ssd_mod.ssd_scan_varlen_triton, second)
        record_check(
            f"ssd {name} resumed at {split} == whole",
            {
                "y": rel_err(torch.cat([y1, y2]), y_whole),
                "state": rel_err(inp["ssm_state"][1], state_whole),
            },
            1e-2,
        )


def ssd_cost(T: int, H: int, P: int, N: int, G: int, chunk: int = 64) -> tuple[float, float]:
    bytes_moved = 2 * T * H * P * 2 + T * H * 2 + 2 * T * G * N * 2
    # per token and head: intra-chunk (scores @ x), C @ S and the state update; CB per group
    flops = T * H * (2 * chunk * P + 4 * N * P) + T * G * 2 * chunk * N
    return bytes_moved, flops


def time_ssd() -> None:
    sizes = [256, 1024] if OPTS.smoke else [4096, 32768, 131072]
    for name, H, P, N, G, _ in MODELS:
        for T in sizes:
            layouts = [("1 seq", [T])]
            if T == 32768 or OPTS.smoke:
                layouts.append(("8 seqs", [T // 8] * 8))
            for label, lengths in layouts:
                inp = ssd_inputs(T, H, P, N, G, lengths, True)
                ms = bench(lambda inp=inp: call_ssd(ssd_mod.ssd_scan_varlen_triton, inp))
                record_time(
                    f"ssd_scan {name} T={T} {label}",
                    ms,
                    *ssd_cost(T, H, P, N, G),
                    kernel="ssd_scan",
                    model=name,
                    tokens=T,
                    seqs=len(lengths),
                    config=ssd_mod._launch_config(inp["x"], len(lengths), H, P, N, 256),
                )
                del inp


def su_inputs(Bt: int, H: int, P: int, N: int, G: int, num_slots: int):
    return dict(
        ssm_state=randn(num_slots, H, P, N, dtype=torch.float32, scale=0.1),
        x=randn(Bt, H, P),
        dt=randn(Bt, H)[:, :, None].expand(Bt, H, P),
        A=(-torch.exp(randn(H, dtype=torch.float32)))[:, None, None].expand(H, P, N),
        B=randn(Bt, G, N),
        C=randn(Bt, G, N),
        D=randn(H, dtype=torch.float32)[:, None].expand(H, P),
        z=randn(Bt, H, P),
        dt_bias=randn(H, dtype=torch.float32)[:, None].expand(H, P),
    )


def check_state_update() -> None:
    for name, H, P, N, G, _ in MODELS:
        Bt = 8 if OPTS.smoke else 256
        inp = su_inputs(Bt, H, P, N, G, Bt + 8)
        slots = torch.randperm(Bt + 8, device=DEV)[:Bt]
        slots[::7] = -1
        pool = inp["ssm_state"].clone()
        y_ref = su_mod.selective_state_update_ref(**inp, state_slots=slots)
        state_ref, inp["ssm_state"] = inp["ssm_state"], pool
        y = su_mod.selective_state_update_triton(**inp, state_slots=slots)
        record_check(
            f"state_update {name} batch={Bt} (padding rows)",
            {"y": rel_err(y, y_ref), "state": rel_err(pool, state_ref)},
            1e-2,
        )


def time_state_update(configs: list[dict[str, int]] | None = None) -> None:
    original = su_mod._launch_config
    batches = [1, 4] if OPTS.smoke else [1, 64, 256]
    try:
        for name, H, P, N, G, _ in MODELS:
            for Bt in batches:
                state_bytes = H * P * N * 4
                # Rotate over slots so small batches read HBM, not L2 (as across layers).
                rounds = max(1, min(64, (512 << 20) // (Bt * state_bytes)))
                inp = su_inputs(Bt, H, P, N, G, Bt * rounds)
                slot_sets = [
                    torch.arange(Bt, device=DEV, dtype=torch.int32) + r * Bt for r in range(rounds)
                ]
                step = [0]

                def run(inp=inp, slot_sets=slot_sets, step=step) -> torch.Tensor:
                    step[0] = (step[0] + 1) % len(slot_sets)
                    return su_mod.selective_state_update_triton(
                        **inp, state_slots=slot_sets[step[0]]
                    )

                bytes_moved = Bt * (2 * state_bytes + H * P * 2 * 3 + 2 * G * N * 2 + H * 2)
                flops = 0.0
                for cfg in configs or [None]:
                    if cfg is not None:
                        su_mod._launch_config = lambda *a, cfg=cfg, **k: cfg
                    ms = bench(run)
                    used = cfg or original(P, triton_next_pow2(N))
                    record_time(
                        f"state_update {name} batch={Bt} fp32 state {used}",
                        ms,
                        bytes_moved,
                        flops,
                        kernel="state_update",
                        model=name,
                        batch=Bt,
                        config=used,
                    )
                del inp
    finally:
        su_mod._launch_config = original


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def sweep_state_update() -> None:
    time_state_update(
        [
            {"block_p": 8, "num_warps": 4},
            {"block_p": 32, "num_warps": 4},
            {"block_p": 64, "num_warps": 8},
            {"block_p": 4, "num_warps": 2},
        ]
    )


# ----------------------------------------------------------------------------- conv1d


def check_conv() -> None:
    for name, *_, Cd in MODELS:
        T = 300 if OPTS.smoke else 8192
        lengths = [T // 2, 3, 1, T - T // 2 - 4]
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        x, w, b = randn(T, Cd), randn(Cd, 4), randn(Cd)
        pool = randn(6, Cd, 3)
        meta = dict(
            cu_seqlens=cu.to(DEV),
            state_slots=torch.tensor([5, 0, 2, 3], device=DEV),
            has_initial_state=torch.tensor([True, True, False, True], device=DEV),
        )
        pool_ref = pool.clone()
        y_ref = conv_mod.causal_conv1d_varlen_ref(x, w, b, conv_state=pool_ref, **meta)
        y = conv_mod.causal_conv1d_varlen_triton(x, w, b, conv_state=pool, **meta)
        record_check(
            f"conv1d varlen {name} T={T}",
            {"y": rel_err(y, y_ref), "state": rel_err(pool, pool_ref)},
            1e-2,
        )
        slots = torch.tensor([1, -1, 4, 0], device=DEV)
        xs = randn(4, Cd)
        pool_ref = pool.clone()
        y_ref = conv_mod.causal_conv1d_update_ref(xs, pool_ref, w, b, state_slots=slots)
        y = conv_mod.causal_conv1d_update_triton(xs, pool, w, b, state_slots=slots)
        record_check(
            f"conv1d update {name}",
            {"y": rel_err(y, y_ref), "state": rel_err(pool, pool_ref)},
            1e-2,
        )


def time_conv() -> None:
    for name, *_, Cd in MODELS:
        w, b = randn(Cd, 4), randn(Cd)
        for T in [1024] if OPTS.smoke else [4096, 32768]:
            x = randn(T, Cd)
            pool = randn(16, Cd, 3)
            meta = dict(
                cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=DEV),
                state_slots=torch.tensor([3], device=DEV),
                has_initial_state=torch.tensor([True], device=DEV),
            )
            ms = bench(
                lambda x=x, pool=pool, meta=meta, w=w, b=b: conv_mod.causal_conv1d_varlen_triton(
                    x, w, b, conv_state=pool, **meta
                )
            )
            record_time(
                f"conv1d varlen {name} T={T}",
                ms,
                2 * T * Cd * 2,
                2 * T * Cd * 4,
                kernel="conv1d_varlen",
                model=name,
            )
        for Bt in [1, 4] if OPTS.smoke else [1, 64, 256]:
            x = randn(Bt, Cd)
            pool = randn(Bt * 8, Cd, 3)
            slots = torch.arange(Bt, device=DEV)
            ms = bench(
                lambda x=x, pool=pool, slots=slots, w=w, b=b: conv_mod.causal_conv1d_update_triton(
                    x, pool, w, b, state_slots=slots
                )
            )
            record_time(
                f"conv1d update {name} batch={Bt}",
                ms,
                Bt * Cd * (2 * 2 + 2 * 3 * 2),
                0.0,
                kernel="conv1d_update",
                model=name,
            )


# ----------------------------------------------------------------------------- others


def check_others() -> None:
    # gated RMSNorm (Bamba: d_inner 8192, one group)
    Dm = 64 if OPTS.smoke else 8192
    x, z, w = randn(512, Dm), randn(512, Dm), randn(Dm)
    y_ref = norm_mod.gated_rms_norm_ref(x, w, z, eps=1e-5)
    y = norm_mod.gated_rms_norm_triton(x, w, z, eps=1e-5)
    record_check("gated_rms_norm 512x8192", {"y": rel_err(y, y_ref)}, 1e-2)
    ms = bench(lambda: norm_mod.gated_rms_norm_triton(x, w, z, eps=1e-5))
    record_time("gated_rms_norm T=512 D=8192", ms, 3 * 512 * Dm * 2, 0.0, kernel="norm")

    # paged attention, Bamba attention dims (32 heads, 8 KV heads, head_dim 128)
    H, KVH, Dh, bs = (4, 2, 16, 16) if OPTS.smoke else (32, 8, 128, 16)
    ctx, q_lens = (
        ([40, 0, 70, 5], [20, 33, 1, 1]) if OPTS.smoke else ([1000, 0, 3000, 511], [500, 777, 1, 1])
    )
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    max_blocks = max(-(-n // bs) for n in seq_lens)
    S = len(seq_lens)
    perm = torch.randperm(S * max_blocks, device=DEV).view(S, max_blocks).to(torch.int32)
    kc, vc = randn(S * max_blocks, bs, KVH, Dh), randn(S * max_blocks, bs, KVH, Dh)
    q = randn(sum(q_lens), H, Dh)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    kw = dict(
        block_tables=perm,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        scale=Dh**-0.5,
    )
    out_ref = attn_mod.paged_attention_ref(q, kc, vc, **kw)
    out = attn_mod.paged_attention_triton(q, kc, vc, **kw)
    record_check("paged_attention mixed prefill/decode GQA", {"out": rel_err(out, out_ref)}, 1e-2)
    # decode: batch 64, 4k context each
    Bt, n = (4, 100) if OPTS.smoke else (64, 4096)
    nb = -(-n // bs)
    kc, vc = randn(Bt * nb, bs, KVH, Dh), randn(Bt * nb, bs, KVH, Dh)
    bt = torch.randperm(Bt * nb, device=DEV).view(Bt, nb).to(torch.int32)
    q = randn(Bt, H, Dh)
    kw = dict(
        block_tables=bt,
        query_start_loc=torch.arange(Bt + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((Bt,), n, dtype=torch.int32, device=DEV),
        scale=Dh**-0.5,
    )
    ms = bench(lambda: attn_mod.paged_attention_triton(q, kc, vc, **kw))
    record_time(
        f"paged_attention decode batch={Bt} ctx={n}",
        ms,
        2 * Bt * n * KVH * Dh * 2,
        4 * Bt * n * H * Dh,
        kernel="paged_attention",
    )

    # Mamba1 selective scan (Mamba-2.8B: d_inner 5120, d_state 16)
    T, Dm, N = (64, 32, 16) if OPTS.smoke else (2048, 5120, 16)
    u, delta = randn(T, Dm), randn(T, Dm, scale=0.5)
    A = -torch.exp(randn(Dm, N, dtype=torch.float32))
    B, C, D, zz = randn(T, N), randn(T, N), randn(Dm, dtype=torch.float32), randn(T, Dm)
    pool = randn(3, Dm, N, dtype=torch.float32)
    meta = dict(
        cu_seqlens=torch.tensor([0, T // 3, T], dtype=torch.int32, device=DEV),
        state_slots=torch.tensor([2, 0], device=DEV),
        has_initial_state=torch.tensor([True, False], device=DEV),
    )
    pool_ref = pool.clone()
    y_ref = sel_mod.selective_scan_varlen_ref(
        u, delta, A, B, C, D, ssm_state=pool_ref, z=zz, **meta
    )
    y = sel_mod.selective_scan_varlen_triton(u, delta, A, B, C, D, ssm_state=pool, z=zz, **meta)
    record_check(
        f"selective_scan mamba1 T={T}",
        {"y": rel_err(y, y_ref), "state": rel_err(pool, pool_ref)},
        1e-2,
    )
    ms = bench(
        lambda: sel_mod.selective_scan_varlen_triton(
            u, delta, A, B, C, D, ssm_state=pool, z=zz, **meta
        )
    )
    record_time(
        f"selective_scan mamba1 T={T} Dm={Dm}", ms, 4 * T * Dm * 2, 0.0, kernel="selective_scan"
    )


# ----------------------------------------------------------------------------- main


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_results() -> None:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    meta = {
        "date": date,
        "gpu": gpu,
        "commit": os.environ.get("BENCH_COMMIT", git_commit()),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    RESULTS["meta"] = meta
    os.makedirs(OPTS.out, exist_ok=True)
    stem = os.path.join(OPTS.out, f"kernels_{date}")
    with open(stem + ".json", "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    lines = [f"# Kernel benchmark {date}", "", *(f"- {k}: {v}" for k, v in meta.items()), ""]
    c = RESULTS["ceilings"]
    if c:
        lines += [
            f"Measured ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
            f"bf16 matmul {c['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s.",
            "",
        ]
    lines += ["| check | rel. error | ok |", "| --- | --- | --- |"]
    for ch in RESULTS["checks"]:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in ch["rel_err"].items())
        lines.append(f"| {ch['name']} | {errs} | {'yes' if ch['ok'] else 'NO'} |")
    lines += [
        "",
        "| kernel | time (us) | floor (us) | bound | time / floor |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in RESULTS["timings"]:
        bound = "mem" if t["mem_floor_ms"] >= t["flop_floor_ms"] else "flop"
        lines.append(
            f"| {t['name']} | {t['ms'] * 1e3:.1f} | {t['floor_ms'] * 1e3:.1f} | {bound} "
            f"| {t['ms'] / t['floor_ms']:.2f} |"
        )
    if RESULTS["errors"]:
        lines += ["", "Errors: " + ", ".join(e["section"] for e in RESULTS["errors"])]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"wrote {stem}.json and .md")


def main() -> None:
    torch.manual_seed(0)
    guarded(ceilings)
    for name, fn in [
        ("check", check_ssd),
        ("check", check_state_update),
        ("check", check_conv),
        ("time", time_ssd),
        ("time", time_state_update),
        ("time", time_conv),
        ("others", check_others),
        ("sweep_su", sweep_state_update),
    ]:
        if section(name):
            guarded(fn)
    write_results()


if __name__ == "__main__":
    main()
