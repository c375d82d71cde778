import os, sys, torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ["SSMSERVE_SSD_GLUON"] = "1"
from bench_ssd import make_inputs, call
from ssmserve.kernels import ssd_scan as m
inp = make_inputs([8192], 128, 64, 128, 1, True)
for _ in range(2):
    call(m.ssd_scan_varlen_triton, inp)
torch.cuda.synchronize()
