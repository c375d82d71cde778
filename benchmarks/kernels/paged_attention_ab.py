"""A/B of the paged-attention prefill path: another paged_attention.py against this one.

    PYTHONPATH=$PWD python3 benchmarks/kernels/paged_attention_ab.py OTHER_paged_attention.py

Same batches as bench_paged_attention.py (Bamba-9B attention dims, bf16, scattered
16-token KV blocks); prints both times, the floor and the relative L2 difference of the
outputs. Needs a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

OTHER = sys.argv[1]
sys.argv = sys.argv[:1]  # bench_paged_attention parses the command line at import
sys.path.insert(0, os.path.dirname(__file__))
import bench_paged_attention as bp  # noqa: E402
from bench_common import bench_ms, rel_err  # noqa: E402

CASES = [
    ("2k chunk over 30k context", [30720], [2048]),
    ("8k chunk over 24k context", [24576], [8192]),
    ("4 x 2k prompts", [0] * 4, [2048] * 4),
    ("mixed 32 decodes 4k + 1k chunk", [4095] * 32 + [3072], [1] * 32 + [1024]),
]


def main() -> None:
    spec = importlib.util.spec_from_file_location("paged_attention_other", OTHER)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    this = bp.attn_mod
    for name, ctx, q_lens in CASES:
        b = bp.make_batch(ctx, q_lens)
        diff = rel_err(
            bp.call(this.paged_attention_triton, b), bp.call(other.paged_attention_triton, b)
        )
        ms_other = bench_ms(lambda b=b: bp.call(other.paged_attention_triton, b))
        ms_this = bench_ms(lambda b=b: bp.call(this.paged_attention_triton, b))
        floor = bp.costs(ctx, q_lens)["floor_ms"]
        print(f"{name:32s} other {ms_other:.3f} ms  this {ms_this:.3f} ms  floor {floor:.3f}  "
              f"rel diff {diff:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
