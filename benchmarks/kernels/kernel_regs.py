"""Registers, spills and shared memory of every compiled variant of the ssmserve kernels
this process has launched (what the JIT really built, with its own specialisation; an
ahead-of-time compile such as ptxas_report.py's can overstate registers).

    from kernel_regs import report
    ...  # run kernels
    report()
"""

from __future__ import annotations

from ssmserve.kernels import paged_attention, ssd_scan


def report() -> None:
    for mod in (paged_attention, ssd_scan):
        for name in dir(mod):
            compiled = getattr(getattr(mod, name), "_compiled", None)
            if not compiled or False not in compiled:  # not launched, or interpreter only
                continue
            for caches in getattr(compiled[False], "device_caches", {}).values():
                cache = caches[0] if isinstance(caches, tuple) else caches
                for kernel in cache.values():
                    md = kernel.metadata
                    print(
                        f"{name}: regs {kernel.n_regs} spills {kernel.n_spills} "
                        f"warps {md.num_warps} stages {md.num_stages} shared {md.shared}",
                        flush=True,
                    )
