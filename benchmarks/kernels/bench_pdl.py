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

- mamba2-2.7b: 64 x [in_proj 10576x2560 -> state update -> out_proj 2560x5120 ->
  residual + RMSNorm];
- llama-3-8b-mlp: 32 x [gate_up 28672x4096 -> SiLU-and-mul -> down 4096x14336 ->
  residual + RMSNorm].

The mixers and the norm are stand-ins, one small Triton kernel each: the state update
reads and writes the layer's float32 state (80 heads x 64 x 128, 2.6 MB) as the real one
does, but the real mixer is two launches with more work (the conv, the gated norm), so
the chains measure the linears, the state traffic and the hand-offs, not the whole
model. Forms: `cublas` (F.linear, stand-ins launched plainly: the engine today),
`cublas+pdl` (the stand-ins launched with PDL), `cublas+pdl+prefetch` (and the state
update loading its state before the wait: the state is written by no other kernel of
the step), `gemv` (the engine's one-row Triton GEMV, `ssmserve/kernels/gemv.py`, no
PDL), `gemv+pdl` (every kernel with PDL; the GEMV loads its first weight tile before
the wait) and `gemv+pdl+prefetch` (the state too: `--decode-pdl`'s form). Sections:
- accuracy: the GEMV against F.linear in float32; each chain's output and state with PDL
  and prefetching equal bit for bit to the same kernels without (graph replays).
- chain: each form's graph replay against the floor: weights read once, states read and
  written once (µs per layer in the JSON).
- sweep: the GEMV's launch parameters in the pdl+prefetch chain.

The Mamba2 chain also runs with the mixer's gated RMSNorm before out_proj (`+norm`: the
norm's kernel, then the GEMV, as decode runs them), whose two launches are checked at the
chain's sizes against float32. `+bare` times the two GEMVs of each layer alone, each
feeding the next: what the kernels between them cost is the difference.
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

from ssmserve.kernels._common import (
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    lazy_jit,
    next_pow2,
    pdl_launch,
    tl,
)
from ssmserve.kernels.gated_rms_norm import gated_rms_norm_ref, gated_rms_norm_triton
from ssmserve.kernels.gemv import gemv_triton

SECTIONS = ("accuracy", "chain", "sweep")
OPTS = parse_args(__doc__, SECTIONS)
DTYPE = torch.bfloat16
# name: (layers, hidden, mixer width D (the second linear's K), SSM heads, state size).
# With heads, the first linear is a Mamba2 in_proj (z, x, B, C, dt: 2D + 2 state + heads
# rows) and the mixer a state update; without, an MLP's gate_up (2D rows) and SiLU-and-mul.
CHAINS = {
    "mamba2-2.7b": (64, 2560, 5120, 80, 128),
    "llama-3-8b-mlp": (32, 4096, 14336, 0, 0),
}
if OPTS.tiny:
    CHAINS = {"tiny-mlp": (2, 40, 24, 0, 0), "tiny-mamba2": (2, 48, 32, 2, 16)}
FORMS = (
    "cublas",
    "cublas+pdl",
    "cublas+pdl+prefetch",
    "gemv",
    "gemv+pdl",
    "gemv+pdl+prefetch",
)
SWEEP: list[dict[str, Any]] = [
    {"block_k": 512},
    {"block_k": 1024},
    {"block_k": 2048},
    {"block_k": 4096},
    {"block_tile": 2048},
    {"block_tile": 4096},
    {"block_tile": 8192},  # the tile before the default halved it for narrow weights
    {"block_tile": 16384},
    {"num_warps": 4},
]


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


@lazy_jit
def _state_update_kernel(
    u_ptr,
    s_ptr,
    v_ptr,
    D,
    HD: tl.constexpr,
    DS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """A Mamba2 decode mixer's stand-in, one program per (head, BLOCK_P head channels):
    s = s exp(-dt) + dt x B, y = (s C) silu(z), from the in_proj output u = [z, x, B, C,
    dt] (one group, A = -1). This layer's state [heads * HD, DS] (float32) is written by
    no other kernel of the step, so with PREFETCH it is loaded before the wait."""
    head = tl.program_id(0)
    p = head * HD + tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, DS)
    s_ptrs = s_ptr + p[:, None] * DS + n[None, :]
    if PDL:
        gdc_launch_dependents()
    if PREFETCH:
        state = tl.load(s_ptrs)
        if PDL:
            gdc_wait()
    else:
        if PDL:
            gdc_wait()
        state = tl.load(s_ptrs)
    z = tl.load(u_ptr + p).to(tl.float32)
    x = tl.load(u_ptr + D + p).to(tl.float32)
    b = tl.load(u_ptr + 2 * D + n).to(tl.float32)
    c = tl.load(u_ptr + 2 * D + DS + n).to(tl.float32)
    dt = tl.load(u_ptr + 2 * D + 2 * DS + head).to(tl.float32)
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
    state = state * tl.exp(-dt) + (dt * x)[:, None] * b[None, :]
    tl.store(s_ptrs, state)
    y = tl.sum(state * c[None, :], axis=1) * z * tl.sigmoid(z)
    tl.store(v_ptr + p, y.to(v_ptr.dtype.element_ty))


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


def gemv(
    x: torch.Tensor, w: torch.Tensor, pdl: bool, config: dict[str, Any] | None
) -> torch.Tensor:
    """The engine's one-row GEMV (ssmserve/kernels/gemv.py): x [K] -> [N]."""
    return gemv_triton(x[None], w, pdl=pdl, config=config)[0]


class Chain:
    """One chain's weights, state and buffers; `run(form)` enqueues its kernels and
    returns h."""

    def __init__(self, layers: int, hidden: int, d: int, heads: int, d_state: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(0)

        def weight(n: int, k: int) -> torch.Tensor:
            w = torch.empty(layers, n, k, device=DEV, dtype=DTYPE)
            for layer in range(layers):  # a float32 layer at a time (Llama's: 0.5 GB)
                w[layer] = torch.randn(n, k, generator=gen, device=DEV) / k**0.5
            return w

        n1 = 2 * d + 2 * d_state + heads
        self.w1, self.w2 = weight(n1, hidden), weight(hidden, d)
        self.layers, self.hidden, self.d, self.heads, self.d_state = (
            layers,
            hidden,
            d,
            heads,
            d_state,
        )
        shape = (layers, d, d_state) if heads else (0,)
        self.s0 = torch.randn(shape, generator=gen, device=DEV) * 0.1
        self.s = self.s0.clone()
        self.v = torch.empty(d, device=DEV, dtype=DTYPE)
        self.h = torch.empty(hidden, device=DEV, dtype=DTYPE)
        self.r = torch.empty(hidden, device=DEV, dtype=torch.float32)
        self.h0 = torch.randn(hidden, generator=gen, device=DEV).to(DTYPE)
        self.nw = (torch.rand(d, generator=gen, device=DEV) + 0.5).to(DTYPE)

    def floor_bytes(self, form: str) -> int:
        """The weights read once and (but in +bare) every layer's state read and written
        once."""
        weights = (self.w1.numel() + self.w2.numel()) * self.w1.element_size()
        if form.endswith("+bare"):
            return weights
        return weights + 2 * self.s.numel() * self.s.element_size()

    def mixer(self, layer: int, u: torch.Tensor, pdl: bool, prefetch: bool) -> None:
        if self.heads:
            hd = self.d // self.heads
            block_p = min(16, hd)
            _state_update_kernel[(self.heads, hd // block_p)](
                u,
                self.s[layer],
                self.v,
                self.d,
                HD=hd,
                DS=self.d_state,
                BLOCK_P=block_p,
                PDL=pdl,
                PREFETCH=prefetch,
                **pdl_launch(pdl),
            )
        else:
            block = 1024
            _silu_mul_kernel[(cdiv(self.d, block),)](
                u, self.v, self.d, BLOCK=block, PDL=pdl, **pdl_launch(pdl)
            )

    def second_linear(
        self, layer: int, form: str, pdl: bool, config: dict[str, Any] | None
    ) -> torch.Tensor:
        """out_proj (down) of the mixer's output v, with the gated norm before it in the
        +norm form."""
        if "+norm" in form:
            v = gated_rms_norm_triton(self.v[None], self.nw, eps=1e-5, pdl=pdl)
            return gemv(v[0], self.w2[layer], pdl, config)
        if form.startswith("cublas"):
            return F.linear(self.v[None], self.w2[layer])[0]
        return gemv(self.v, self.w2[layer], pdl, config)

    def run(self, form: str, config: dict[str, Any] | None = None) -> torch.Tensor:
        self.h.copy_(self.h0)
        self.r.copy_(self.h0)
        pdl, prefetch, cublas = "pdl" in form, "prefetch" in form, form.startswith("cublas")
        for layer in range(self.layers):
            if cublas:
                u = F.linear(self.h[None], self.w1[layer])[0]
            else:
                u = gemv(self.h, self.w1[layer], pdl, config)
            if form.endswith("+bare"):  # the GEMVs alone, each feeding the next
                self.h.copy_(gemv(u[: self.d], self.w2[layer], pdl, config))
                continue
            self.mixer(layer, u, pdl, prefetch)
            o = self.second_linear(layer, form, pdl, config)
            _add_norm_kernel[(1,)](
                o,
                self.r,
                self.h,
                self.hidden,
                BLOCK=next_pow2(self.hidden),
                PDL=pdl,
                num_warps=4,
                **pdl_launch(pdl),
            )
        return self.h


def _pdl_possible() -> bool:
    return DEV.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)


def _forms() -> tuple[str, ...]:
    return FORMS if _pdl_possible() else tuple(f for f in FORMS if "pdl" not in f)


def _norm_forms(heads: int) -> tuple[str, ...]:
    """A Mamba2 chain's form with the gated norm before out_proj (none for an MLP chain)."""
    base = "gemv+pdl+prefetch" if _pdl_possible() else "gemv"
    return (base + "+norm",) if heads else ()


def _bare_form() -> str:
    """The chain's two GEMVs a layer and nothing else (the first's output cut to the
    second's K, the second's fed to the next layer): their cost without the kernels
    between them."""
    return ("gemv+pdl" if _pdl_possible() else "gemv") + "+bare"


def _check_norm_then_gemv(name: str, hidden: int, d: int, gen: torch.Generator) -> None:
    """The +norm form's two launches (the gated norm's kernel, then the GEMV into
    out_proj) at a Mamba2 chain's sizes against float32, with and without PDL (eager)."""
    w2 = torch.randn(hidden, d, generator=gen, device=DEV).to(DTYPE) / d**0.5
    nw = (torch.rand(d, generator=gen, device=DEV) + 0.5).to(DTYPE)
    v = torch.randn(1, d, generator=gen, device=DEV).to(DTYPE)
    ref = F.linear(gated_rms_norm_ref(v.float(), nw.float(), eps=1e-5), w2.float())
    # The chain's mixer output reaches ~1e10 (unscaled random weights): the norm's
    # squares then reach ~1e20 a term, which a float32 sum of squares must survive.
    # (The norm is scale-invariant: the reference stands.)
    cases = [(False, 1.0), (False, 1e10)] + ([(True, 1.0)] if _pdl_possible() else [])
    for pdl, scale in cases:
        normed = gated_rms_norm_triton(v * scale, nw, eps=1e-5, pdl=pdl)
        errors = {"gated_rms_norm, gemv": rel_err(gemv(normed[0], w2, pdl, None), ref[0])}
        label = f"{name} norm then GEMV against float32" + (", PDL" if pdl else "")
        label += f", mixer output x {scale:g}" if scale != 1.0 else ""
        record_check(label, errors, 2e-2)


def accuracy() -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    for name, (_, hidden, d, heads, d_state) in CHAINS.items():
        for n, k in ((2 * d + 2 * d_state + heads, hidden), (hidden, d)):
            w = torch.randn(n, k, generator=gen, device=DEV).to(DTYPE)
            x = torch.randn(k, generator=gen, device=DEV).to(DTYPE)
            ref = F.linear(x.float(), w.float())
            out = gemv(x, w, False, None)
            errors = {"gemv": rel_err(out, ref), "F.linear": rel_err(F.linear(x, w), ref)}
            record_check(f"{name} {n}x{k} bf16 against float32", errors)
        if heads:
            _check_norm_then_gemv(name, hidden, d, gen)
    if not _pdl_possible():
        log("accuracy: no sm_90 GPU, the PDL forms are not run")
        return
    for name, shape in CHAINS.items():
        c = Chain(*shape)
        for plain, with_pdl in (("cublas", "cublas+pdl+prefetch"), ("gemv", "gemv+pdl+prefetch")):
            outputs = []
            for form in (plain, with_pdl):
                graph, h = capture(lambda c=c, form=form: c.run(form))
                c.s.copy_(c.s0)
                graph.replay()
                torch.cuda.synchronize()
                outputs.append(h.clone())
                outputs.append(c.s.clone())
            errors = {
                "h": rel_err(outputs[2], outputs[0]),
                "state": rel_err(outputs[3], outputs[1]),
            }
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
    floor = floor_ms(chain.floor_bytes(form))
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
        for form in _forms() + _norm_forms(shape[3]) + (_bare_form(),):
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
