"""Debug helper for ssd_gluon_blocks.py: where the block kernel differs from the twin."""
import os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
import ssd_gluon_blocks as sb
from ssmserve.kernels import ssd_scan_hopper
from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref, ssd_scan_varlen_triton
from test_triton_ssd_scan import make_inputs, run

os.environ["SSMSERVE_SSD_GLUON"] = "1"
ssd_scan_hopper.launch_hopper_scan = sb.launch_blocks
LENGTHS = [300, 1, 0, 600, 256, 77]
SLOTS = [5, 0, 2, 1, 4, 3]


def case(keep, init, reps=3):
    inp = make_inputs(LENGTHS, 8, 64, 1, 128, num_slots=6, dtype=torch.bfloat16, seed=11,
                      with_dz=True, packed_xbc=True)
    for k in ("D", "z", "dt_bias"):
        if k not in keep:
            inp[k] = None
    ref = {k: (v.float() if k in ("x", "B", "C", "z") and v is not None else v) for k, v in inp.items()}
    ref["ssm_state"] = inp["ssm_state"].clone()
    y_ref = run(ssd_scan_varlen_ref, ref, LENGTHS, SLOTS, init)
    scale = y_ref.norm() / y_ref.numel() ** 0.5
    pool = inp["ssm_state"].clone()
    for rep in range(reps):
        inp["ssm_state"] = pool.clone()
        y = run(ssd_scan_varlen_triton, inp, LENGTHS, SLOTS, init).float()
        bad, t = [], 0
        for s, L in enumerate(LENGTHS):
            for b in range(0, L, 64):
                e = (y[t + b:t + min(b + 64, L)] - y_ref[t + b:t + min(b + 64, L)]).abs().amax(dim=(0, 2)) / scale
                bad += [f"s{s}b{b // 64}h{h}:{v:.2f}" for h, v in enumerate(e.tolist()) if v > 0.3]
            t += L
        print(f"keep={keep} init={init[0]} rep {rep}: rel {((y - y_ref).norm() / y_ref.norm()):.2e} bad {bad}", flush=True)


for keep in (("D", "z", "dt_bias"), ("D", "z"), ("z",), ("D",), ("dt_bias",), ("D", "dt_bias")):
    case(keep, [True, False, True, True, False, True])
case(("D", "z", "dt_bias"), [False] * 6)
