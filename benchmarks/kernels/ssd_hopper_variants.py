"""Source variants of the Gluon SSD kernel (ssmserve/kernels/ssd_scan_hopper.py), each
checked against the float32 twin and timed at 32k tokens, Bamba-9B dims, on an H100/H200.

    PYTHONPATH=$PWD:$PWD/benchmarks/kernels:$PWD/tests/kernels \\
        python benchmarks/kernels/ssd_hopper_variants.py [variant ...]

A variant is a list of edits to the module's source: (old, new) replaces text, (start,
end, new) replaces the region from start up to end. Each variant is written to a
temporary file and imported as its own module, so variants compile side by side. The check
runs a varlen batch with D, z and initial states six times: the fifth session's
shared-memory race showed only there, and not on every run. "no Gluon kernel" times the
rest of the call (metadata launch and host work), which every variant includes.
Without arguments all variants run; the session notes and results files record what
each gave (variants adopted since are dropped here).
"""

from __future__ import annotations

import functools
import os
import sys

import bench_ssd as bs
import torch
import triton.testing
from bench_common import module_from_source, rel_err
from test_triton_ssd_scan import make_inputs, run

from ssmserve.kernels import ssd_scan_hopper
from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref, ssd_scan_varlen_triton

SRC = open(ssd_scan_hopper.__file__).read()
OUT_ARRIVE = (
    "                gl.thread_barrier()\n"
    "                mbarrier.arrive(bars.index(EMPTY + s), count=1)\n"
)
OUT_FENCE = "                fence_async_shared()  # see _state\n"
VARIANTS: dict[str, list[tuple[str, ...]]] = {
    "base": [],
    "four_stages": [("NUM_STAGES = 3", "NUM_STAGES = 4")],
    "regs_24_160_160": [("[24, 152, 152]", "[24, 160, 160]")],
    # Timing only (wrong results): the outputs do nothing but the barrier protocol.
    "outputs_skipped": [
        (
            "                cb = warpgroup_mma(c_s.index(s), b_s",
            "                rows = t0",
            "                gl.thread_barrier()\n"
            "                mbarrier.arrive(bars.index(S_EMPTY + W), count=1)\n"
            "                mbarrier.arrive(bars.index(EMPTY + s), count=1)\n"
            "                acc = zeros\n",
        ),
    ],
}
# Timing only: the state chain alone (outputs skipped) without one of its parts.
SKIP = VARIANTS["outputs_skipped"]
VARIANTS.update({
    "chain_no_release_fence": SKIP + [(
        "            fence_async_shared()\n            gl.thread_barrier()\n"
        "            mbarrier.arrive(bars.index(EMPTY + s)",
        "            gl.thread_barrier()\n            mbarrier.arrive(bars.index(EMPTY + s)",
    )],
    "chain_no_snapshot": SKIP + [(
        "            s_s.index(w).store(snap)\n            fence_async_shared()\n", "",
    )],
    "chain_no_dot": SKIP + [
        ("            state = warpgroup_mma(a, b_s.index(s), state, is_async=True)\n", ""),
        ("            state, a = warpgroup_mma_wait(num_outstanding=0, deps=(state, a))\n", ""),
    ],
    "chain_no_prep": SKIP + [(
        "                a_next, end_next = _prep(x_s, cum_s, dt_s, (g + 1) % NS, a_s)\n",
        "                a_next, end_next = a, end\n",
    )],
    # The x^T weighting of the state update in packed bf16 (one HMUL2 per two elements).
    "prep_bf16x2": [(
        "    return (xT.to(gl.float32) * weights[None, :]).to(dtype), end\n",
        "    w2 = weights.to(dtype)[None, :] + gl.zeros_like(xT)\n"
        "    prod = gl.inline_asm_elementwise('mul.rn.bf16x2 $0, $1, $2;', '=r,r,r',\n"
        "                                     [xT, w2], dtype=gl.bfloat16, is_pure=True, pack=2)\n"
        "    return prod, end\n",
    )],
})  # fmt: skip
VARIANTS["chain_prep_bf16x2"] = SKIP + VARIANTS["prep_bf16x2"]
# Releases without a proxy fence: with D on the diagonal tile, no generic shared-memory
# read of a stage is still in flight when either partition releases it.
VARIANTS["no_release_fences"] = VARIANTS["chain_no_release_fence"][1:] + [(OUT_FENCE, "")]
# The next chunk's scalars loaded as 1-element tensors and reduced at the chunk's end, so
# the load's latency is not waited for at its issue.
VARIANTS["late_chunk_scalars"] = [
    (
        "        seq_next = gl.load(chunk_seq_ptr + c_next)\n"
        "        nb_next = (gl.load(chunk_len_ptr + c_next) + BLOCK - 1) // BLOCK\n",
        "        one = gl.arange(0, 1, layout=gl.BlockedLayout([1], [32], [4], [0]))\n"
        "        seq_next_t = gl.load(chunk_seq_ptr + c_next + one)\n"
        "        len_next_t = gl.load(chunk_len_ptr + c_next + one)\n",
    ),
    (
        "        if (seq_next != seq) | (c + 1 == num_chunks):\n",
        "        seq_next = gl.sum(seq_next_t, 0)\n"
        "        nb_next = (gl.sum(len_next_t, 0) + BLOCK - 1) // BLOCK\n"
        "        if (seq_next != seq) | (c + 1 == num_chunks):\n",
    ),
]
VARIANTS["both"] = VARIANTS["no_release_fences"] + VARIANTS["late_chunk_scalars"]
# y_by_tma (whole output blocks by TMA store, 0.886 -> 0.740 ms) was adopted at 7596233.
LENGTHS = [300, 1, 0, 600, 256, 77]
SLOTS = [5, 0, 2, 1, 4, 3]
INIT = [True, False, True, True, False, True]


def build(name: str, edits: list[tuple[str, ...]]):
    src = SRC
    for edit in edits:
        if len(edit) == 3:
            start, end, new = edit
            i = src.index(start)
            src = src[:i] + new + src[src.index(end, i) :]
        else:
            assert edit[0] in src, (name, edit[0])
            src = src.replace(*edit)
    return module_from_source(f"ssd_hopper_{name}", src)


def main() -> None:
    os.environ["SSMSERVE_SSD_GLUON"] = "1"
    inp = make_inputs(LENGTHS, 8, 64, 1, 128, num_slots=6, dtype=torch.bfloat16, seed=11,
                      with_dz=True, packed_xbc=True)  # fmt: skip
    ref = {k: (v.float() if k in ("x", "B", "C", "z") and v is not None else v)
           for k, v in inp.items()}  # fmt: skip
    ref["ssm_state"] = inp["ssm_state"].clone()
    y_ref = run(ssd_scan_varlen_ref, ref, LENGTHS, SLOTS, INIT)
    pool = inp["ssm_state"].clone()
    big = bs.make_inputs([32768], 128, 64, 128, 1, True)
    big_pool = big["ssm_state"].clone()
    os.environ["SSMSERVE_SSD_GLUON"] = "0"
    y_tl = bs.call(ssd_scan_varlen_triton, big)
    os.environ["SSMSERVE_SSD_GLUON"] = "1"
    timed = functools.partial(bs.call, ssd_scan_varlen_triton, big)
    launch = ssd_scan_hopper.launch_hopper_scan
    ssd_scan_hopper.launch_hopper_scan = lambda *args: None
    ms = triton.testing.do_bench(timed, warmup=50, rep=300)
    print(f"no Gluon kernel (metadata launch, host): {ms:.3f} ms", flush=True)
    try:
        for name, edits in VARIANTS.items():
            if len(sys.argv) > 1 and name not in sys.argv[1:]:
                continue
            ssd_scan_hopper.launch_hopper_scan = build(name, edits).launch_hopper_scan
            errs = []
            for _ in range(6):
                inp["ssm_state"] = pool.clone()
                y = run(ssd_scan_varlen_triton, inp, LENGTHS, SLOTS, INIT).float()
                errs.append(((y - y_ref).norm() / y_ref.norm()).item())
            big["ssm_state"] = big_pool.clone()
            y = bs.call(ssd_scan_varlen_triton, big)
            ms = triton.testing.do_bench(timed, warmup=50, rep=300)
            print(f"{name:20s} rel. errors vs twin " + " ".join(f"{e:.1e}" for e in errs)
                  + f" | 32k: {ms:.3f} ms, y vs Triton-language {rel_err(y, y_tl):.1e}",
                  flush=True)  # fmt: skip
    finally:
        ssd_scan_hopper.launch_hopper_scan = launch


if __name__ == "__main__":
    main()
