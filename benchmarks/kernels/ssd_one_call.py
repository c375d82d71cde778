"""One 32k-token SSD scan call at Bamba-9B dims, after a warm-up call: a target for ncu.

    ncu --clock-control none --kernel-name regex:_ssd_scan_hopper_kernel --launch-skip 1 \\
        --launch-count 1 --set full -o prof python benchmarks/kernels/ssd_one_call.py
"""

import bench_ssd as bs
import torch

from ssmserve.kernels.ssd_scan import ssd_scan_varlen_triton

inp = bs.make_inputs([32768], 128, 64, 128, 1, True)
for _ in range(2):
    bs.call(ssd_scan_varlen_triton, inp)
torch.cuda.synchronize()
