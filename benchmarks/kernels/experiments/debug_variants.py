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
FENCE_E = "                fence_async_shared()  # see _state\n" + ARRIVE_E
DX = "                acc += d * x_s.index(s).load(mma_y).to(gl.float32)\n"
CBD = "                a = gl.convert_layout((cb * decay).to(dtype), a_y)\n"
CBD_D = ("                cbd = cb * decay\n"
         "                cbd = gl.where(offs_rc[:, None] == offs_kc[None, :], cbd + d, cbd)  # + D x\n"
         "                a = gl.convert_layout(cbd.to(dtype), a_y)\n")
VARIANTS = {
    "base": [],
    "empty_at_end": [(FENCE_E, ""), (STORE_END, STORE_END + ARRIVE_E)],
    "d_folded": [(DX, ""), (CBD, CBD_D)],
    "d_folded_empty_at_end": [(DX, ""), (CBD, CBD_D), (FENCE_E, ""), (STORE_END, STORE_END + ARRIVE_E)],
    "simple_state": "_simple_state.py",
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
ssd_scan_hopper.launch_hopper_scan = lambda *args: None
ms = triton.testing.do_bench(functools.partial(bs.call, ssd_scan_varlen_triton, big), warmup=50, rep=300)
print(f"everything but the Gluon kernel (cumsum, C.B^T, host): {ms:.3f} ms", flush=True)
for name, edits in VARIANTS.items():
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    src = SRC if not isinstance(edits, str) else open(os.path.join(HERE, edits)).read()
    if isinstance(edits, str) and not os.path.exists(os.path.join(HERE, edits)):
        print(name, "skipped: no", edits)
        continue
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
    ms = triton.testing.do_bench(functools.partial(bs.call, ssd_scan_varlen_triton, big), warmup=50, rep=300)
    print(f"{name:22s} rel errs " + " ".join(f"{e:.1e}" for e in errs)
          + f" | 32k: {ms:.3f} ms, vs TL y {rel_err(y, y_tl):.1e}", flush=True)
