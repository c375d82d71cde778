"""Run Triton kernels in the CPU interpreter (TRITON_INTERPRET=1) for tests and smoke runs.

The product never patches Triton; this harness does, because Triton 3.6's interpreter has
two problems that would make CPU results depend on the numpy version and on import order:

1. It holds scalars as shape-(1,) arrays and converts them with `int(array)`, which numpy
   >= 2.4 rejects, so `for i in range(start, end)` with a runtime bound fails
   (triton-lang/triton#9171). `__index__` is defined the way the upstream fix does.
2. Triton's own library functions (tl.sum, tl.cumsum, ...) are decorated when triton is
   imported; if that happened before TRITON_INTERPRET=1 was set (transformers imports
   triton), they are compiled-mode functions that refuse to run inside the interpreter.
   Inside an interpreted launch, every JITFunction is run as an interpreted function.

Both patches apply only while the interpreter runs a launch: the interpreter installs and
restores its own patches around each launch, and these ride on that.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

_MARK = "_ssmserve_tests_patch"


def patch_interpreter() -> None:
    """Install the two workarounds above (idempotent; no-op without triton)."""
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
    setattr(interpreter, _MARK, True)


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
