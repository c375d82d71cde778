"""Compile recorded Triton launches for an sm_90 GPU, in a process of its own.

`python tests/kernels/gpu_compile.py LAUNCHES.pt` reads [(module, kernel name, args,
kwargs)] (tensors stand in by dtype and 16-byte alignment, as Triton specialises them)
and compiles each as a launch on an H100/H200 would, through Triton 3.6's own steps
(JITFunction.run / _pack_args) with its CUDA backend and bundled ptxas; no GPU needed.
It runs apart from the tests because the interpreter the tests run in leaves Triton's
language objects patched for interpreted code. Prints one line per failure; exit 1 if any.
"""

from __future__ import annotations

import importlib
import sys

import torch


def compile_for_sm90(fn, do_not_specialize, args: list, kwargs: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    jit = JITFunction(fn, do_not_specialize=do_not_specialize)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    kwargs = {**kwargs, "debug": False, "instrumentation_mode": ""}
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    src = ASTSource(jit, signature, constexprs, attrs)
    triton.compile(src, target=target, options=options.__dict__)


def main(path: str) -> int:
    failed = 0
    for module, name, args, kwargs in torch.load(path, weights_only=False):
        kernel = getattr(importlib.import_module(module), name)
        try:
            compile_for_sm90(kernel.fn, kernel.do_not_specialize, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - report every kernel that fails
            failed += 1
            print(f"{name}: {type(exc).__name__}: {str(exc)[-1200:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
