"""What are this GPU's ceilings, the rates every kernel floor divides by?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_ceilings.py

Device copy (1 GiB bf16 buffers, far beyond L2; bytes read + written) and bf16 matrix
product (8192^3, random data), medians of triton.testing.do_bench. The other kernel
benchmarks divide by the H200's figures (bench_common.COPY_BYTES_PER_S, BF16_FLOP_PER_S);
on another GPU, compare their floors with this run's. The floor column of this run is
the measurement itself.
"""

from __future__ import annotations

import torch
from bench_common import DEV, RESULTS, bench_ms, environment, finish, log, parse_args, run_sections

OPTS = parse_args(__doc__, ("copy", "matmul"))
COPY_ELEMS, MATMUL_N = (1 << 10, 64) if OPTS.tiny else (1 << 29, 8192)


def copy() -> None:
    src = torch.randn(COPY_ELEMS, device=DEV).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    rate = 2 * COPY_ELEMS * 2 / (ms * 1e-3)
    RESULTS["copy_bytes_per_s"] = rate
    name = f"copy of {COPY_ELEMS * 2 / 2**20:g} MiB: {rate / 1e12:.3f} TB/s"
    RESULTS["timings"].append({"name": name, "ms": ms, "floor_ms": ms})
    log(f"copy: {rate / 1e12:.3f} TB/s (read + write)")


def matmul() -> None:
    a, b = (torch.randn(MATMUL_N, MATMUL_N, device=DEV).to(torch.bfloat16) for _ in range(2))
    ms = bench_ms(lambda: a @ b)
    rate = 2 * MATMUL_N**3 / (ms * 1e-3)
    RESULTS["bf16_flop_per_s"] = rate
    name = f"bf16 matmul {MATMUL_N}^3: {rate / 1e12:.0f} TFLOP/s"
    RESULTS["timings"].append({"name": name, "ms": ms, "floor_ms": ms})
    log(f"bf16 matmul: {rate / 1e12:.0f} TFLOP/s")


def main() -> None:
    environment(OPTS)
    run_sections(OPTS, dict(copy=copy, matmul=matmul))
    finish(OPTS, "ceilings", "Device ceilings")


if __name__ == "__main__":
    main()
