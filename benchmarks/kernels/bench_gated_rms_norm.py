"""How fast is the gated RMSNorm after the Mamba2 scan, next to its floor?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_gated_rms_norm.py          # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_gated_rms_norm.py --tiny   # CPU smoke

Bamba-9B's d_inner 8192 (one group) and Codestral Mamba's 8 groups of 1024, bf16, gated.
Sections:
- accuracy: Triton against the twin, whole-row and grouped, gate before and after.
- sizes: 1 (decode), 512 and 8192 (prefill) rows.
Floor: x and z read, y written once (bf16).
"""

from __future__ import annotations

import torch
from bench_common import (
    DEV,
    bench_ms,
    environment,
    finish,
    floor_ms,
    parse_args,
    record_check,
    record_time,
    rel_err,
    run_sections,
)

from ssmserve.kernels.gated_rms_norm import gated_rms_norm_ref, gated_rms_norm_triton

SECTIONS = ("accuracy", "sizes")
OPTS = parse_args(__doc__, SECTIONS)
D_INNER, CASES, ROWS = 8192, (("1 group", None), ("8 groups", 1024)), (1, 512, 8192)
if OPTS.tiny:
    D_INNER, CASES, ROWS = 64, (("1 group", None), ("4 groups", 16)), (1, 5)


def inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x and z [T, D_INNER] and the weight [D_INNER], bf16."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)

    return rand(T, D_INNER), rand(T, D_INNER), rand(D_INNER)


def accuracy() -> None:
    x, z, w = inputs(ROWS[1])
    for label, group in CASES:
        for before in (False, True):
            kw = dict(eps=1e-5, group_size=group, norm_before_gate=before)
            errors = {
                "y": rel_err(
                    gated_rms_norm_triton(x, w, z, **kw), gated_rms_norm_ref(x, w, z, **kw)
                )
            }
            record_check(f"{label} norm_before_gate={before}", errors)


def sizes() -> None:
    for T in ROWS:
        x, z, w = inputs(T, seed=T)
        for label, group in CASES:
            ms = bench_ms(
                lambda x=x, z=z, w=w, g=group: gated_rms_norm_triton(
                    x, w, z, eps=1e-5, group_size=g
                )
            )
            record_time(f"T={T} D={D_INNER} {label}", ms, floor_ms(3 * T * D_INNER * 2))


def main() -> None:
    environment(OPTS)
    run_sections(OPTS, dict(accuracy=accuracy, sizes=sizes))
    finish(OPTS, "gated_rms_norm", "Gated RMSNorm")


if __name__ == "__main__":
    main()
