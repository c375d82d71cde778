"""Registers and spills of every compiled variant of the kernels run so far in this process."""
import sys
from ssmserve.kernels import paged_attention, ssd_scan

def report():
    for mod in (paged_attention, ssd_scan):
        for name in dir(mod):
            k = getattr(mod, name)
            compiled = getattr(k, "_compiled", None)
            if not compiled or False not in compiled:
                continue
            jit = compiled[False]
            for dev, caches in getattr(jit, "device_caches", {}).items():
                cache = caches[0] if isinstance(caches, tuple) else caches
                for key, ck in cache.items():
                    md = ck.metadata
                    print(f"{name}: regs {ck.n_regs} spills {ck.n_spills} warps {md.num_warps} stages {md.num_stages} shared {md.shared}", flush=True)
