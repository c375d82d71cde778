import os, sys, torch, triton
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_ssd import make_inputs, call
from ssmserve.kernels import ssd_scan as m
inp = make_inputs([32768], 128, 64, 128, 1, True)
rows = []
for label, env in [("TL", {"SSMSERVE_SSD_GLUON": "0"}), ("gluon", {}), ("gluon no phase3", {"SSMSERVE_SSD_SKIP": "1"}),
                   ("gluon no chain wait", {"SSMSERVE_SSD_SKIP": "2"}), ("gluon phase1 only (no wait, no ph3)", {"SSMSERVE_SSD_SKIP": "3"}),
                   ("gluon phase3 w/o phase1 dots, no wait", {"SSMSERVE_SSD_SKIP": "6"}), ("gluon skeleton (no ph1 dots, no wait, no ph3)", {"SSMSERVE_SSD_SKIP": "7"})]:
    os.environ.pop("SSMSERVE_SSD_SKIP", None); os.environ["SSMSERVE_SSD_GLUON"] = "1"
    os.environ.update(env)
    ms = triton.testing.do_bench(lambda: call(m.ssd_scan_varlen_triton, inp), warmup=50, rep=300)
    print(f"{label:50s} {ms:.3f} ms", flush=True)
