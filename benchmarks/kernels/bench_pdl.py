"""Does programmatic dependent launch (PDL) take batch-1 decode toward the weight-read floor?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_pdl.py          # GPU (sm_90)
    PYTHONPATH=$PWD python benchmarks/kernels/bench_pdl.py --tiny   # CPU smoke run

A batch-1 decode step is a chain of small kernels, each waiting for the one before it to
finish: cuBLAS reads Mamba2-2.7B's in_proj at 1.27x its floor and its out_proj at 1.7x
(bamba9b/mamba2 decode profiles in benchmarks/results/), the gap being each GEMV's ramp
and tail. With PDL a kernel is launched while its predecessor still runs; it may read
what no kernel of the step writes (the weights) before `griddepcontrol.wait`, and must
read and write everything else after it. Here a GEMV that loads its first weight tile
before that wait is set against F.linear, in chains shaped like a model's decode layers,
each captured whole in one CUDA graph (the engine's decode) with its weights distinct
per layer, so every layer reads its own from HBM:

- mamba2-2.7b: 64 x [in_proj 10576x2560 -> mixer stand-in -> out_proj 2560x5120 ->
  residual + RMSNorm stand-in];
- llama-3-8b-mlp: 32 x [gate_up 28672x4096 -> SiLU-and-mul -> down 4096x14336 ->
  residual + RMSNorm stand-in].

The stand-ins are one small Triton kernel each (the real mixer is two launches and more
work), so the chains measure the linears and the hand-offs, not the whole model. Forms:
`cublas` (F.linear, stand-ins launched plainly: the engine today), `cublas+pdl` (the
stand-ins launched with PDL), `gemv` (the Triton GEMV, no PDL), `gemv+pdl` (every kernel
with PDL, the GEMV waiting before its first load) and `gemv+pdl+prefetch` (its first
weight tile loaded before the wait). Sections:
- accuracy: the GEMV against F.linear in float32; each chain's output with PDL equal bit
  for bit to the same kernels without it (ordering kept under graph replay).
- chain: each form's graph replay, ms per layer against the weight-read floor.
- sweep: the GEMV's launch parameters in the pdl+prefetch chain.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
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

from ssmserve.kernels._common import cdiv, lazy_jit, next_pow2, tl

SECTIONS = ("accuracy", "chain", "sweep")
OPTS = parse_args(__doc__, SECTIONS)
DTYPE = torch.bfloat16
# name: (layers, first linear N x K, mixer width D (the second linear's K), hidden)
CHAINS = {
    "mamba2-2.7b": (64, 10576, 5120, 2560),
    "llama-3-8b-mlp": (32, 28672, 14336, 4096),
}
if OPTS.tiny:
    CHAINS = {"tiny": (2, 80, 24, 40), "tiny-even": (2, 96, 32, 48)}
FORMS = ("cublas", "cublas+pdl", "gemv", "gemv+pdl", "gemv+pdl+prefetch")
SWEEP: list[dict[str, Any]] = [
    {"block_k": 512},
    {"block_k": 1024},
    {"block_k": 2048},
    {"block_k": 4096},
    {"tile": 4096},
    {"tile": 16384},
    {"num_warps": 4},
]

try:  # griddepcontrol: Triton's wrappers of the PTX instructions (sm_90 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton (CPU-only installs): --tiny needs it anyway
    gdc_launch_dependents = gdc_wait = None


@lazy_jit(do_not_specialize=["N"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """out[n] = sum_k w[n, k] x[k], BLOCK_N rows a program, K walked in BLOCK_K tiles with
    the next tile's load issued before the current one's multiply. With PREFETCH the
    first tile is loaded before waiting for the previous kernel (the weights are written
    by no kernel of the chain); x is read only after it. EVEN_K (BLOCK_K divides K): no
    masks, so every load is a 16-byte vector."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N read the last row (in bounds, unmasked); their sums are not stored.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if PDL:
        gdc_launch_dependents()
    if PREFETCH:
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)
        if PDL:
            gdc_wait()
    else:
        if PDL:
            gdc_wait()
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K - BLOCK_K, BLOCK_K):
        # Every tile but the last, and the next tile's load before this one's multiply.
        ks = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_ptr + ks)
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K))
        else:
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
            w_next = tl.load(w_ptrs + (k0 + BLOCK_K), mask=(ks + BLOCK_K)[None, :] < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w = w_next
    ks = tl.cdiv(K, BLOCK_K) * BLOCK_K - BLOCK_K + offs_k
    if EVEN_K:
        x = tl.load(x_ptr + ks)
    else:
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
    acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@lazy_jit(do_not_specialize=["D"])
def _silu_mul_kernel(u_ptr, v_ptr, D, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """v[i] = silu(u[i]) * u[D + i]: the mixer's (and the MLP's) stand-in."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    a = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(u_ptr + D + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(v_ptr + offs, (a * tl.sigmoid(a) * b).to(v_ptr.dtype.element_ty), mask=ok)


@lazy_jit(do_not_specialize=["H"])
def _add_norm_kernel(o_ptr, r_ptr, h_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """r += o (float32 residual); h = r / rms(r) in the weights' dtype: one program, as
    add_rms_norm runs a row at batch 1."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    r = tl.load(r_ptr + offs, mask=ok, other=0.0) + tl.load(o_ptr + offs, mask=ok, other=0.0)
    tl.store(r_ptr + offs, r, mask=ok)
    inv = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / H + 1e-6)
    tl.store(h_ptr + offs, (r * inv).to(h_ptr.dtype.element_ty), mask=ok)


def _launch_options(pdl: bool) -> dict[str, Any]:
    return {"launch_pdl": True} if pdl else {}


def gemv_config(N: int, K: int, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """block_k: the largest power of two up to 4096 that divides K (else K's next power of
    two, capped); tile: weight elements a program holds per step (block_n = tile /
    block_k rows, 8192 = 16 KB of bf16 by default); num_warps 8."""
    cfg = {"block_k": None, "tile": 8192, "num_warps": 8, **(config or {})}
    if cfg["block_k"] is None:
        block_k = 4096
        while block_k > 16 and K % block_k:
            block_k //= 2
        cfg["block_k"] = block_k if K % block_k == 0 else min(next_pow2(K), 4096)
    if OPTS.tiny:
        cfg["block_k"], cfg["tile"] = 16, 64
    cfg["block_n"] = max(1, cfg["tile"] // cfg["block_k"])
    return cfg


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    pdl: bool,
    prefetch: bool,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """out [N] = w [N, K] @ x [K]."""
    N, K = w.shape
    cfg = gemv_config(N, K, config)
    _gemv_kernel[(cdiv(N, cfg["block_n"]),)](
        x,
        w,
        out,
        N,
        K,
        w.stride(0),
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        EVEN_K=K % cfg["block_k"] == 0,
        PDL=pdl,
        PREFETCH=prefetch,
        num_warps=cfg["num_warps"],
        **_launch_options(pdl),
    )
    return out


class Chain:
    """One chain's weights and buffers; `run(form)` enqueues its kernels and returns h."""

    def __init__(self, layers: int, n1: int, d: int, hidden: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(0)

        def weight(n: int, k: int) -> torch.Tensor:
            w = torch.randn(layers, n, k, generator=gen, device=DEV, dtype=torch.float32)
            return (w / k**0.5).to(DTYPE)

        self.w1, self.w2 = weight(n1, hidden), weight(hidden, d)
        self.layers, self.d, self.hidden = layers, d, hidden
        self.u = torch.empty(n1, device=DEV, dtype=DTYPE)
        self.v = torch.empty(d, device=DEV, dtype=DTYPE)
        self.o = torch.empty(hidden, device=DEV, dtype=DTYPE)
        self.h = torch.empty(hidden, device=DEV, dtype=DTYPE)
        self.r = torch.empty(hidden, device=DEV, dtype=torch.float32)
        self.h0 = torch.randn(hidden, generator=gen, device=DEV).to(DTYPE)

    @property
    def weight_bytes(self) -> int:
        return (self.w1.numel() + self.w2.numel()) * self.w1.element_size()

    def run(self, form: str, config: dict[str, Any] | None = None) -> torch.Tensor:
        self.h.copy_(self.h0)
        self.r.copy_(self.h0)
        pdl = form != "cublas" and form != "gemv"
        block = 1024
        for layer in range(self.layers):
            if form.startswith("cublas"):
                torch.mm(self.h[None], self.w1[layer].t(), out=self.u[None])
            else:
                gemv(self.h, self.w1[layer], self.u, pdl, "prefetch" in form, config)
            _silu_mul_kernel[(cdiv(self.d, block),)](
                self.u, self.v, self.d, BLOCK=block, PDL=pdl, **_launch_options(pdl)
            )
            if form.startswith("cublas"):
                torch.mm(self.v[None], self.w2[layer].t(), out=self.o[None])
            else:
                gemv(self.v, self.w2[layer], self.o, pdl, "prefetch" in form, config)
            _add_norm_kernel[(1,)](
                self.o,
                self.r,
                self.h,
                self.hidden,
                BLOCK=next_pow2(self.hidden),
                PDL=pdl,
                num_warps=4,
                **_launch_options(pdl),
            )
        return self.h


def _pdl_possible() -> bool:
    return DEV.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)


def _forms() -> tuple[str, ...]:
    return FORMS if _pdl_possible() else tuple(f for f in FORMS if "pdl" not in f)


def accuracy() -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    for name, (_, n1, d, hidden) in CHAINS.items():
        for n, k in ((n1, hidden), (hidden, d)):
            w = torch.randn(n, k, generator=gen, device=DEV).to(DTYPE)
            x = torch.randn(k, generator=gen, device=DEV).to(DTYPE)
            ref = F.linear(x.float(), w.float())
            out = gemv(x, w, torch.empty(n, device=DEV, dtype=DTYPE), False, False)
            errors = {"gemv": rel_err(out, ref), "F.linear": rel_err(F.linear(x, w), ref)}
            record_check(f"{name} {n}x{k} bf16 against float32", errors)
    if not _pdl_possible():
        log("accuracy: no sm_90 GPU, the PDL forms are not run")
        return
    for name, shape in CHAINS.items():
        c = Chain(*shape)
        for plain, with_pdl in (("cublas", "cublas+pdl"), ("gemv", "gemv+pdl+prefetch")):
            outputs = []
            for form in (plain, with_pdl):
                graph, h = capture(lambda c=c, form=form: c.run(form))
                graph.replay()
                torch.cuda.synchronize()
                outputs.append(h.clone())
            errors = {"h": rel_err(outputs[1], outputs[0])}
            record_check(f"{name}: {with_pdl} == {plain}, graph replays", errors, 0.0)
        del c
        torch.cuda.empty_cache()


def _time_chain(name: str, chain: Chain, form: str, config: dict[str, Any] | None) -> float:
    if DEV.type == "cuda":
        graph, _ = capture(lambda: chain.run(form, config))
        ms = bench_ms(graph.replay, warmup=5, rep=30)
        del graph
    else:
        ms = bench_ms(lambda: chain.run(form, config))
    floor = floor_ms(chain.weight_bytes)
    per_layer = 1e3 / chain.layers
    record_time(
        f"{name} {form}" + (f" {config}" if config else ""),
        ms,
        floor,
        chain=name,
        form=form,
        config=config,
        us_per_layer=ms * per_layer,
        floor_us_per_layer=floor * per_layer,
    )
    return ms


def chain() -> None:
    for name, shape in CHAINS.items():
        c = Chain(*shape)
        for form in _forms():
            _time_chain(name, c, form, None)
        del c
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


def sweep() -> None:
    form = "gemv+pdl+prefetch" if _pdl_possible() else "gemv"
    for name, shape in CHAINS.items():
        c = Chain(*shape)
        for config in SWEEP:
            _time_chain(name, c, form, config)
        del c
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    environment(OPTS, dtype=str(DTYPE), chains=CHAINS, forms=FORMS)
    run_sections(OPTS, {"accuracy": accuracy, "chain": chain, "sweep": sweep})
    finish(OPTS, "pdl", "Programmatic dependent launch in batch-1 decode chains")
