"""Debug helper: source variants of ssd_gluon_blocks.py against the twin on the racy case."""
import importlib.util, os, sys
import torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ssmserve.kernels import ssd_scan_hopper
from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref, ssd_scan_varlen_triton
from test_triton_ssd_scan import make_inputs, run

os.environ["SSMSERVE_SSD_GLUON"] = "1"
LENGTHS = [300, 1, 0, 600, 256, 77]
SLOTS = [5, 0, 2, 1, 4, 3]
INIT = [True, False, True, True, False, True]
SRC = open(os.path.join(HERE, "ssd_gluon_blocks.py")).read()
ARRIVE_E = "                gl.thread_barrier()\n                mbarrier.arrive(bars.index(EMPTY + s), count=1)\n"
STORE_END = "                         acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip\n"
VARIANTS = {
    "base": [],
    "r168": [("[48, 152, 152]", "[24, 168, 168]")],
    "r176": [("[48, 152, 152]", "[24, 176, 176]")],
    "cb_by_tma": "_cbtma.py",
    "no_state_fence": [("            fence_async_shared()\n            gl.thread_barrier()\n            mbarrier.arrive(bars.index(EMPTY + s)",
                        "            gl.thread_barrier()\n            mbarrier.arrive(bars.index(EMPTY + s)")],
    "out_skip": [("                cb = warpgroup_mma(c_s.index(s), b_s", "                rows = t0",
                  "                gl.thread_barrier()\n                mbarrier.arrive(bars.index(S_EMPTY + W), count=1)\n"
                  "                mbarrier.arrive(bars.index(EMPTY + s), count=1)\n                acc = zeros\n")],
    "state_skip": [("            cum_v = cum_s.index(s)\n            cum_k = cum_v.load(k_l)", "            # Generic-proxy reads",
                    "            end = ref\n")],
    "out_no_diag": [("                cb = warpgroup_mma(c_s.index(s), b_s", "                acc = warpgroup_mma(c_s.index(s), s_s",
                     ""),
                    ("                # The diagonal tile's operand while the C.S dot runs.", "                acc = warpgroup_mma_wait(num_outstanding=0",
                     "                cum_v = cum_s.index(s)\n"),
                    ("                acc = warpgroup_mma(a, x_s.index(s), acc, is_async=True)\n", "                acc += d",
                     "")],
    "empty_at_end": [(ARRIVE_E, ""), (STORE_END, STORE_END + ARRIVE_E)],
    "fence_before_arrives": [(ARRIVE_E, "                fence_async_shared()\n" + ARRIVE_E),
                             ("            gl.thread_barrier()\n            mbarrier.arrive(bars.index(EMPTY + s), count=1)\n",
                              "            fence_async_shared()\n            gl.thread_barrier()\n            mbarrier.arrive(bars.index(EMPTY + s), count=1)\n")],
    "empty_at_end_ns4": [(ARRIVE_E, ""), (STORE_END, STORE_END + ARRIVE_E), ("NUM_STAGES = 3", "NUM_STAGES = 4")],
    "ns4": [("NUM_STAGES = 3", "NUM_STAGES = 4")],
    "regs168": [("[48, 152, 152]", "[40, 168, 168]")],
}
inp = make_inputs(LENGTHS, 8, 64, 1, 128, num_slots=6, dtype=torch.bfloat16, seed=11,
                  with_dz=True, packed_xbc=True)
ref = {k: (v.float() if k in ("x", "B", "C", "z") and v is not None else v) for k, v in inp.items()}
ref["ssm_state"] = inp["ssm_state"].clone()
y_ref = run(ssd_scan_varlen_ref, ref, LENGTHS, SLOTS, INIT)
pool = inp["ssm_state"].clone()
import functools
import triton.testing
import bench_ssd as bs
from bench_common import rel_err
big = bs.make_inputs([32768], 128, 64, 128, 1, True)
big_pool = big["ssm_state"].clone()
os.environ["SSMSERVE_SSD_GLUON"] = "0"
y_tl = bs.call(ssd_scan_varlen_triton, big)
os.environ["SSMSERVE_SSD_GLUON"] = "1"
for name, edits in VARIANTS.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    src = SRC if not isinstance(edits, str) else open(os.path.join(HERE, edits)).read()
    for edit in ([] if isinstance(edits, str) else edits):
        if len(edit) == 3:  # (start, end, new): replace the region from start up to end
            a, b, new = edit
            i = src.index(a)
            j = src.index(b, i)
            src = src[:i] + new + src[j:]
            continue
        old, new = edit
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = f"/tmp/ssd_blocks_{name}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"ssd_blocks_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ssd_scan_hopper.launch_hopper_scan = mod.launch_blocks
    errs = []
    for rep in range(6):
        inp["ssm_state"] = pool.clone()
        y = run(ssd_scan_varlen_triton, inp, LENGTHS, SLOTS, INIT).float()
        errs.append(((y - y_ref).norm() / y_ref.norm()).item())
    big["ssm_state"] = big_pool.clone()
    y = bs.call(ssd_scan_varlen_triton, big)
    ms = triton.testing.do_bench(functools.partial(bs.call, ssd_scan_varlen_triton, big))
    print(f"{name:22s} rel errs " + " ".join(f"{e:.1e}" for e in errs)
          + f" | 32k: {ms:.3f} ms, vs TL y {rel_err(y, y_tl):.1e}", flush=True)
