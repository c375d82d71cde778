"""Where the SSD scan kernel's time goes: time source-edited variants at 32k tokens.

    PYTHONPATH=$PWD python3 benchmarks/kernels/ssd_variants.py --out variants.json

Each variant is ssd_scan.py with one part of _ssd_chunk_scan_kernel cut out or changed
(outputs are then wrong: these are timings, not results), written to a temporary module
and timed with triton.testing.do_bench at Bamba-9B mixer dims, 32k tokens, one sequence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback

import torch
import triton.testing
from bench_common import module_from_source

# These variants are of the Triton-language kernel, which an H100/H200 otherwise skips
# for bf16 inputs (ssd_scan_hopper.py takes those calls).
os.environ.setdefault("SSMSERVE_SSD_GLUON", "0")
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "ssmserve", "kernels", "ssd_scan.py")
P1_END = "        # 2. The chained step."
P3_START = "        # 3. Outputs, BLOCK rows"
P1_START = "        # 1. The chunk's contribution"
KERNEL_END = "def _launch_config("


def cut(src: str, start: str, end: str, insert: str) -> str:
    a, b = src.index(start), src.index(end)
    return src[:a] + insert + src[b:]


def variants(src: str) -> dict[str, str]:
    out = {"full": src}
    # phases 1+2 only: contributions and the chain, no outputs
    out["phase1+2"] = cut(src, P3_START, KERNEL_END, "\n\n")
    # phase 1 only: no chain, no outputs
    out["phase1"] = cut(
        src,
        P1_END,
        KERNEL_END,
        "        tl.store(y_ptr + lane, tl.sum(tl.sum(contrib, 0), 0))\n\n\n",
    )
    # phase 3 only: entering state read from the slot, no contribution, no chain
    p3 = cut(
        src,
        P1_START,
        P3_START,
        (
            "        state_in = tl.load(state_ptr + head * stride_s_h"
            " + offs_n[:, None] * stride_s_n + offs_p[None, :] * stride_s_p)\n"
        ),
    )
    out["phase3"] = p3
    out["phase3 no diagonal"] = p3.replace(
        "            acc += tl.dot(\n                scores.to(DOT_DTYPE)",
        "            acc += 0 * tl.dot(\n                scores.to(DOT_DTYPE)",
    )
    out["phase3 no off-diagonal"] = p3.replace("if m0 > 0:", "if m0 < 0:")
    for name in ("phase3 no diagonal", "phase3 no off-diagonal"):
        if out[name] == p3:
            raise SystemExit(f"ssd_variants.py: the '{name}' edit no longer matches ssd_scan.py")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="variants.json")
    ap.add_argument("--configs", default="[{}]", help="JSON list of _launch_config overrides")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run")
    ap.add_argument(
        "--once", action="store_true", help="run each variant 3 times, untimed (for ncu)"
    )
    opts = ap.parse_args()
    dev = torch.device("cuda")
    T, H, P, N, G = 32768, 128, 64, 128, 1
    gen = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(T, H, P, generator=gen, device=dev).to(bf)
    dt = (torch.randn(T, H, generator=gen, device=dev) * 0.5).to(bf)
    A = -torch.exp(torch.rand(H, generator=gen, device=dev) * math.log(16.0))
    B = torch.randn(T, G, N, generator=gen, device=dev).to(bf)
    C = torch.randn(T, G, N, generator=gen, device=dev).to(bf)
    D = torch.ones(H, device=dev)
    dt_bias = torch.full((H,), -3.0, device=dev)
    state = torch.randn(2, H, P, N, generator=gen, device=dev) * 0.1
    kw = dict(cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=dev), ssm_state=state,
              state_slots=torch.tensor([1], dtype=torch.int32, device=dev),
              has_initial_state=torch.tensor([True], device=dev), dt_bias=dt_bias,
              chunk_size=256)  # fmt: skip
    results = []
    with open(SRC) as f:
        src = f.read()
    for override in json.loads(opts.configs):
        for name, vsrc in variants(src).items():
            if opts.only and name not in opts.only.split(","):
                continue
            try:
                mod = module_from_source(f"ssd_variant_{abs(hash(name))}", vsrc)
                base = mod._launch_config
                mod._launch_config = lambda *a, base=base, o=override: {**base(*a), **o}
                fn = lambda mod=mod: mod.ssd_scan_varlen_triton(x, dt, A, B, C, D, **kw)  # noqa: E731
                if opts.once:
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    ms = math.nan
                else:
                    ms = float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
            except Exception:  # noqa: BLE001 - a variant may not compile
                ms = math.nan
                traceback.print_exc()
            results.append({"variant": name, "config": override, "ms": ms})
            print(f"{json.dumps(override):40s} {name:28s} {ms:8.3f} ms", flush=True)
    with open(opts.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
