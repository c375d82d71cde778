"""Helpers shared by the kernel files: shape checks, dt preprocessing, lazy Triton.

Triton is optional: `import ssmserve.kernels` must work on machines without it (CPU
installs use the `*_ref` twins). When it is missing, `tl` is a stand-in that only
supports what kernel *definitions* touch at import time (`tl.constexpr` in
annotations); launching a kernel then raises with a message saying what to install.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl
else:

    class _MissingTritonLanguage:
        """Stand-in for `triton.language` so kernel signatures can be defined."""

        constexpr = Any

    triton = None
    tl = _MissingTritonLanguage()


def interpret_mode() -> bool:
    """Whether Triton kernels will run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on `device`, or None if they can."""
    if not HAS_TRITON:
        return (
            "kernel backend 'triton' needs the triton package; install it "
            "(pip install triton) or use kernel_backend='torch'"
        )
    if device.type == "cpu" and not interpret_mode():
        return (
            "kernel backend 'triton' on CPU needs the Triton interpreter; set "
            "TRITON_INTERPRET=1 (slow, for tests) or use kernel_backend='torch'"
        )
    if device.type not in ("cpu", "cuda"):
        return f"kernel backend 'triton' does not support device type {device.type!r}"
    return None


class LazyKernel:
    """A Triton kernel whose `triton.jit` decoration happens at first launch.

    NOTE: Triton reads TRITON_INTERPRET when a function is decorated, not when it is
    launched. Decorating at import time would make the mode depend on import order
    (e.g. a test that sets the flag after another test imported this package), so we
    decorate on first use and re-decorate if the flag changes. Kernels wrapped this
    way must not call other wrapped functions: Triton would not see them as kernels.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._compiled: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        if not HAS_TRITON:
            raise RuntimeError(triton_unavailable_reason(torch.device("cuda")))
        mode = interpret_mode()
        if mode not in self._compiled:
            if mode:
                _patch_interpreter()
            self._compiled[mode] = triton.jit(self.fn)
        return self._compiled[mode][grid]


_interpreter_patched = False


def _patch_interpreter() -> None:
    """Work around two Triton 3.6 interpreter problems (CPU tests only).

    1. The interpreter holds scalars as shape-(1,) arrays and converts them with
       `int(array)`, which numpy >= 2.4 rejects, so `for i in range(start, end)` with a
       runtime bound fails (triton-lang/triton#9171). We define `__index__` the way
       the upstream fix does.
    2. Triton's own library functions (tl.sum, tl.cumsum, ...) are decorated when
       triton is imported; if that happened before TRITON_INTERPRET=1 was set (e.g.
       transformers imports triton), they are compiled-mode functions that refuse to
       run inside the interpreter. We run them the way interpreted device functions
       run, so interpreter results do not depend on import order.
    """
    global _interpreter_patched
    if _interpreter_patched:
        return
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

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
    _interpreter_patched = True


def lazy_jit(fn: Callable[..., None]) -> LazyKernel:
    """Decorator form of `LazyKernel`."""
    return LazyKernel(fn)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= n (n >= 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Number of streaming multiprocessors of a CUDA device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise ValueError unless `t` has `shape` (None entries match any size)."""
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        pretty = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {pretty}, got {list(t.shape)}")


def process_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """dt (+ bias) -> softplus (optional) -> clamp to dt_limit, in float32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def check_varlen(
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_tokens: int,
    num_slots: int,
) -> list[tuple[int, int, int, bool]]:
    """Validate varlen metadata and return [(start, end, slot, has_init)] per sequence."""
    num_seqs = state_slots.shape[0]
    check_shape("cu_seqlens", cu_seqlens, [num_seqs + 1])
    check_shape("has_initial_state", has_initial_state, [num_seqs])
    cu = cu_seqlens.tolist()
    slots = state_slots.tolist()
    init = has_initial_state.tolist()
    if (
        cu[0] != 0
        or cu[-1] != num_tokens
        or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True))
    ):
        raise ValueError(
            f"cu_seqlens must be non-decreasing from 0 to the number of tokens ({num_tokens}), "
            f"got {cu}"
        )
    if any(not 0 <= s < num_slots for s in slots):
        raise ValueError(f"state_slots must lie in [0, {num_slots}) for prefill, got {slots}")
    return [(cu[i], cu[i + 1], slots[i], bool(init[i])) for i in range(num_seqs)]
