"""Shared helpers for kernel tests: tolerances, random inputs, naive recurrences.

The naive references loop over tokens in float64, independently of the chunked
twins, so a bug in the chunked algebra cannot hide in both.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# (atol, rtol) for comparing an output of the given dtype with a float64/float32 truth.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    scale: float = 1.0,
    msg: str = "",
) -> None:
    """Compare with the tolerance of `dtype` (default: actual's dtype) times `scale`."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=atol * scale,
        rtol=rtol * scale,
        msg=lambda m: f"{msg}\n{m}" if msg else m,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(
    *shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def naive_dt(
    dt: torch.Tensor, bias: torch.Tensor | None, softplus: bool, limit: tuple[float, float]
) -> torch.Tensor:
    dt = dt.double()
    if bias is not None:
        dt = dt + bias.double()
    if softplus:
        dt = torch.log1p(torch.exp(dt))
    return dt.clamp(min=limit[0], max=limit[1])


def naive_ssd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, state0):
    """One sequence. x [L,H,P], dt [L,H], B/C [L,G,N], state0 [H,P,N] -> (y, state)."""
    L, H, P = x.shape
    G = B.shape[1]
    dt = naive_dt(dt, dt_bias, dt_softplus, dt_limit)
    state = state0.double().clone()
    y = torch.zeros(L, H, P, dtype=torch.float64)
    for t in range(L):
        for h in range(H):
            g = h // (H // G)
            state[h] = torch.exp(dt[t, h] * A[h].double()) * state[h] + dt[t, h] * torch.outer(
                x[t, h].double(), B[t, g].double()
            )
            y[t, h] = state[h] @ C[t, g].double()
            if D is not None:
                y[t, h] += D[h].double() * x[t, h].double()
    if z is not None:
        y = y * F.silu(z.double())
    return y, state


def naive_selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, state0):
    """One sequence. u/delta [L,Dm], A [Dm,N], B/C [L,N], state0 [Dm,N]."""
    L, Dm = u.shape
    delta = naive_dt(delta, delta_bias, delta_softplus, (0.0, math.inf))
    state = state0.double().clone()
    y = torch.zeros(L, Dm, dtype=torch.float64)
    for t in range(L):
        state = (
            torch.exp(delta[t, :, None] * A.double()) * state
            + (delta[t] * u[t].double())[:, None] * B[t].double()[None, :]
        )
        y[t] = state @ C[t].double()
        if D is not None:
            y[t] += D.double() * u[t].double()
    if z is not None:
        y = y * F.silu(z.double())
    return y, state


def naive_conv1d(x, weight, bias, context, activation):
    """One sequence. x [L,Cd], weight [Cd,K], context [Cd,K-1] -> (y [L,Cd], new ctx)."""
    L, Cd = x.shape
    K = weight.shape[1]
    window = [context[:, i].double() for i in range(K - 1)]
    y = torch.zeros(L, Cd, dtype=torch.float64)
    for t in range(L):
        window.append(x[t].double())
        acc = torch.zeros(Cd, dtype=torch.float64)
        for k in range(K):
            acc += weight[:, k].double() * window[len(window) - K + k]
        if bias is not None:
            acc += bias.double()
        y[t] = F.silu(acc) if activation == "silu" else acc
    new_context = torch.stack(window[len(window) - (K - 1) :], dim=1)
    return y, new_context


def run_benchmark_tiny(script: str, sections: str, tmp_path: Path) -> dict:
    """benchmarks/kernels/<script> --tiny --sections <sections> in its own process (Triton's
    interpreter without a GPU): its results JSON, after asserting that it exited 0."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / (Path(script).stem + ".json")
    argv = [sys.executable, str(root / "benchmarks" / "kernels" / script), "--tiny"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [*argv, "--sections", sections, "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())
