"""Compile the SSD scan kernels for sm_90 on any machine (no GPU needed) and report
ptxas's register, spill and shared-memory figures per launch config.

    python benchmarks/kernels/ptxas_report.py [--dtype bf16] [--config '{"num_warps": 8}']

Uses Triton's ahead-of-time compile (GPUTarget cuda 90) and the ptxas Triton ships.
Spills or serialised-wgmma warnings (C7515) here predict slow kernels on the H200
before any device time is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from ssmserve.kernels import ssd_scan

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
DTYPES = {"bf16": ("bf16", "bf16"), "fp16": ("fp16", "fp16"), "fp32": ("fp32", "fp32")}


SASS_OUT: str | None = None  # --sass: where to write the disassembly of the last compile


def compile_report(
    fn, signature: dict[str, str], constexprs: dict, options: dict, source=ASTSource
) -> str:
    """ptxas -v output (registers, spills, smem) of one kernel specialisation.

    Specialised the way Triton's JIT specialises a real launch at Bamba-9B dims: unit
    strides (the last dim of every tensor) become the constant 1, and pointers and the
    other integers are marked divisible by 16 (that is what lets loads vectorise; without
    it the register figures are far too pessimistic).
    """
    names = list(signature)
    attrs = {}
    for i, name in enumerate(names):
        if signature[name] == "constexpr":
            continue
        if name.startswith("stride_") and name.endswith(("_p", "_n")):
            signature[name] = "constexpr"
            constexprs = {**constexprs, name: 1}
        elif name.startswith("stride_") or name.endswith("_ptr") or name in ("H", "P", "N"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    jitted = fn if isinstance(fn, JITFunction) else triton.jit(fn)
    src = source(fn=jitted, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    out = subprocess.run(
        [PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    os.unlink(f.name)
    if SASS_OUT:
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as c:
            c.write(compiled.asm["cubin"])
        sass = subprocess.run(
            [os.path.join(os.path.dirname(PTXAS), "nvdisasm"), "-c", "-g", c.name],
            capture_output=True,
            text=True,
            check=False,
        )
        os.unlink(c.name)
        with open(SASS_OUT, "w") as out_file:
            out_file.write(sass.stdout or sass.stderr)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines()]
    keep = [ln for ln in lines if re.search(r"registers|spill|C7515|smem|error", ln)]
    return f"shared {compiled.metadata.shared} B; " + " | ".join(keep)


def scan_kernel_report(dtype: str, cfg: dict) -> str:
    t = DTYPES[dtype][0]
    names = ssd_scan._ssd_chunk_scan_kernel.fn.__code__.co_varnames[
        : ssd_scan._ssd_chunk_scan_kernel.fn.__code__.co_argcount
    ]
    sig: dict[str, str] = {}
    for name in names:
        if name.startswith(("HAS_", "BLOCK", "CHUNK", "DOT_", "STATE_D", "STATE_P")):
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in ("x_ptr", "B_ptr", "C_ptr", "z_ptr", "y_ptr", "cb_ptr"):
                sig[name] = f"*{t}"
            elif name == "has_init_ptr":
                sig[name] = "*i8"
            elif name in ("state_ptr", "ring_ptr", "D_ptr", "dt_buf_ptr", "cum_buf_ptr"):
                sig[name] = "*fp32"
            else:
                sig[name] = "*i32"
        else:
            sig[name] = "i32"
    dots = {
        "bf16": ("bf16", "tf32", "bf16", "tf32"),
        "fp16": ("fp16", "tf32", "fp32", "tf32"),
        "fp32": ("fp32", "ieee", "fp32", "ieee"),
    }[dtype]
    tl_dtype = {
        "bf16": triton.language.bfloat16,
        "fp16": triton.language.float16,
        "fp32": triton.language.float32,
    }
    constexprs = {
        "HAS_D": True,
        "HAS_Z": cfg.get("has_z", False),
        "CHUNK": cfg["chunk"],
        "BLOCK": cfg["block"],
        "BLOCK_T": cfg["block_t"],
        "BLOCK_P": cfg["block_p"],
        "P_BLOCKS": 64 // cfg["block_p"],
        "BLOCK_N": 128,
        "DOT_DTYPE": tl_dtype[dots[0]],
        "DOT_PRECISION": dots[1],
        "STATE_DOT_DTYPE": tl_dtype[dots[2]],
        "STATE_PRECISION": dots[3],
    }
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    return compile_report(ssd_scan._ssd_chunk_scan_kernel.fn, sig, constexprs, options)


def gluon_report(
    fn,
    constexprs: dict,
    descs: dict[str, tuple[int, int]],
    options: dict,
    extra_sig: dict[str, str] | None = None,
) -> str:
    """compile_report for a Gluon kernel of the SSD scan family: `descs` maps each tensor
    descriptor argument to its bf16 block shape; `extra_sig` gives other arguments' types
    outright; the rest are typed by name."""
    import triton.experimental.gluon.language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    sig: dict[str, str] = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif extra_sig and name in extra_sig:
            sig[name] = extra_sig[name]
        elif name in descs:
            layout = gl.NVMMASharedLayout.get_default_for(list(descs[name]), gl.bfloat16)
            sig[name] = f"tensordesc<bf16[{descs[name][0]}, {descs[name][1]}],{layout!r}>"
        elif name in ("z_ptr", "y_ptr", "cb_ptr"):
            sig[name] = "*bf16"
        elif name in ("state_ptr", "D_ptr", "dt_buf_ptr", "cum_buf_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i8" if name == "has_init_ptr" else "*i32"
        else:
            sig[name] = "i32"
    return compile_report(fn, sig, constexprs, options, source=GluonASTSource)


def hopper_kernel_report(N: int) -> str:
    """The same for the Gluon kernel of ssd_scan_hopper.py (bf16, head dim 64)."""
    import triton.experimental.gluon.language as gl

    from ssmserve.kernels import ssd_scan_hopper as hopper

    blk = hopper.BLOCK_TOKENS
    descs = {"x_desc": (blk, 64), "b_desc": (blk, N), "c_desc": (blk, N), "y_desc": (blk, 64)}
    vec = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    extra = {name: f"tensordesc<fp32[{blk}],{vec!r}>" for name in ("cum_desc", "dt_desc")}
    return gluon_report(
        hopper._ssd_scan_hopper_kernel, dict(P=64, N=N), descs, {"num_warps": 4}, extra_sig=extra
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        help="JSON overrides of _launch_config (repeatable)",
    )
    parser.add_argument("--sass", default=None, help="write the SASS of the last config here")
    parser.add_argument(
        "--hopper", action="store_true", help="the Gluon kernel (ssd_scan_hopper.py), N 128, 64"
    )
    opts = parser.parse_args()
    global SASS_OUT
    SASS_OUT = opts.sass
    os.environ.pop("TRITON_INTERPRET", None)
    if opts.hopper:
        for N in (128, 64):
            print(f"gluon N={N}: {hopper_kernel_report(N)}", flush=True)
        return
    base = ssd_scan._launch_config(None, 1, 128, 64, 128, 256)
    for override in opts.config or ["{}"]:
        cfg = {**base, **json.loads(override)}
        print(f"{json.dumps(cfg)}\n  scan: {scan_kernel_report(opts.dtype, cfg)}", flush=True)


if __name__ == "__main__":
    main()
