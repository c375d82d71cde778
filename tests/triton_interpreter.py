"""Run Triton kernels in the CPU interpreter (TRITON_INTERPRET=1) for tests and smoke runs.

The product never patches Triton; this harness does, because Triton 3.6's interpreter has
two problems that would make CPU results depend on the numpy version and on import order,
and two that make it needlessly slow:

1. It holds scalars as shape-(1,) arrays and converts them with `int(array)`, which numpy
   >= 2.4 rejects, so `for i in range(start, end)` with a runtime bound fails
   (triton-lang/triton#9171). `__index__` is defined the way the upstream fix does.
2. Triton's own library functions (tl.sum, tl.cumsum, ...) are decorated when triton is
   imported; if that happened before TRITON_INTERPRET=1 was set (transformers imports
   triton), they are compiled-mode functions that refuse to run inside the interpreter.
   Inside an interpreted launch, every JITFunction is run as an interpreted function.
3. `tl.associative_scan` with a user combine function calls it once per element, on
   scalars (the Mamba1 selective scan spent 147 of a test's 200 s there). A combine
   function is elementwise, so calling it once per position along the scan axis, on the
   whole slice, computes every element with the same operations in the same order.
4. It checks every 32-bit integer add, subtract and multiply for overflow (cast both sides
   to int64, redo the operation, compare with the bounds, assert): compiled kernels do that
   only with debug on, and the tests' shapes are far from 2^31. The check is switched off
   (`sanitize_overflow`): a whole-model test (`test_one_row_gemv_gives_the_tokens_of_f_linear
   [bamba]`) took 62 s with it and 38 s without.

The first three patches apply only while the interpreter runs a launch: the interpreter
installs and restores its own patches around each launch, and these ride on that.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

_MARK = "_ssmserve_tests_patch"


def patch_interpreter() -> None:
    """Install the workarounds above (idempotent; no-op without triton)."""
    if importlib.util.find_spec("triton") is None:
        return
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    if getattr(interpreter, _MARK, False):
        return
    original = interpreter._patch_lang_tensor
    interpreted: dict[Any, Any] = {}

    def call_as_interpreted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.fn not in interpreted:
            interpreted[self.fn] = interpreter.InterpretedFunction(self.fn)
        return interpreted[self.fn](*args, **kwargs)

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))
        scope.set_attr(JITFunction, "__call__", call_as_interpreted)

    interpreter._patch_lang_tensor = patched
    interpreter.ScanOps.generic_scan = _scan_by_slices
    # 4. above: builders made later and the one already made check no integer overflow.
    options = functools.partial(interpreter.InterpreterOptions, sanitize_overflow=False)
    interpreter.InterpreterOptions = options
    interpreter.interpreter_builder.options = options()
    setattr(interpreter, _MARK, True)


def _scan_by_slices(self: Any, inputs: list[Any]) -> list[Any]:
    """The interpreter's generic scan, one combine call per position along the axis."""
    import numpy as np

    arrays = [np.moveaxis(arg.handle.data, self.axis, 0) for arg in inputs]
    outputs = [np.empty_like(a) for a in arrays]
    for out, a in zip(outputs, arrays):
        out[0] = a[0]
    for i in range(1, arrays[0].shape[0]):
        acc = [self.to_tensor(out[i - 1], arg.dtype) for out, arg in zip(outputs, inputs)]
        cur = [self.to_tensor(a[i], arg.dtype) for a, arg in zip(arrays, inputs)]
        result = self.combine_fn.fn(*acc, *cur)
        for out, value in zip(outputs, result if isinstance(result, tuple) else (result,)):
            out[i] = value.handle.data if hasattr(value, "handle") else value
    return [
        self.to_tensor(np.ascontiguousarray(np.moveaxis(out, 0, self.axis)), arg.dtype)
        for out, arg in zip(outputs, inputs)
    ]


@contextlib.contextmanager
def interpreter_mode() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside the block (restored after), with the workarounds.

    ssmserve decorates its kernels at first launch and again when the flag changes, so
    setting the flag here works whatever was imported before.
    """
    patch_interpreter()
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
