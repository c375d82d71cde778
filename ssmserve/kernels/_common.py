"""Helpers shared by the kernel files: shape checks, dt preprocessing, lazy Triton.

Triton is optional: `import ssmserve.kernels` must work on machines without it (CPU
installs use the `*_ref` twins). When it is missing, `tl` is a stand-in that only
supports what kernel *definitions* touch at import time (`tl.constexpr` in
annotations); launching a kernel then raises with a message saying what to install.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
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


try:  # Programmatic dependent launch: griddepcontrol, sm_90 and later (Triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:
    HAS_GDC = False
    gdc_launch_dependents = gdc_wait = None


def pdl_unavailable_reason(device: torch.device) -> str | None:
    """Why kernels cannot be launched with programmatic dependent launch on `device`."""
    if not HAS_GDC:
        return "programmatic dependent launch needs Triton >= 3.4 (griddepcontrol)"
    if device.type != "cuda" or interpret_mode():
        return "programmatic dependent launch needs a CUDA GPU (not the interpreter)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "programmatic dependent launch needs an sm_90 or later GPU"
    return None


def pdl_launch(pdl: bool) -> dict[str, Any]:
    """Launch options of a kernel taking `PDL` (see docs/kernels.md, "Programmatic
    dependent launch"): with pdl the kernel may start while its predecessor in the stream
    still runs, so it must read only never-written data (weights) or data no kernel
    before it in the step writes before its `gdc_wait()`."""
    return {"launch_pdl": True} if pdl else {}


def interpret_mode() -> bool:
    """Whether Triton kernels will run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_unavailable_reason(device: torch.device, backend: str = "triton") -> str | None:
    """Why Triton kernels cannot run on `device` for kernel backend `backend`, or None."""
    if not HAS_TRITON:
        return (
            f"kernel backend {backend!r} needs the triton package; install it "
            "(pip install triton) or use kernel_backend='torch'"
        )
    if device.type == "cpu" and not interpret_mode():
        return (
            f"kernel backend {backend!r} on CPU needs the Triton interpreter; set "
            "TRITON_INTERPRET=1 (slow, for tests) or use kernel_backend='torch'"
        )
    if device.type not in ("cpu", "cuda"):
        return f"kernel backend {backend!r} does not support device type {device.type!r}"
    return None


class LazyKernel:
    """A Triton kernel whose `triton.jit` decoration happens at first launch.

    NOTE: Triton reads TRITON_INTERPRET when a function is decorated, not when it is
    launched. Decorating at import time would make the mode depend on import order
    (e.g. a test that sets the flag after another test imported this package), so we
    decorate on first use and re-decorate if the flag changes. Kernels wrapped this
    way must not call other wrapped functions: Triton would not see them as kernels.

    `do_not_specialize` names the arguments Triton must not specialise (it otherwise
    compiles a variant for an integer equal to 1 and one for multiples of 16, and one for
    a pointer aligned to 16 bytes): every count, stride and index array that follows the
    batch goes there, so that a new batch shape reuses the compiled kernel
    (docs/kernels.md, "Compilation per batch shape").
    """

    def __init__(self, fn: Callable[..., None], do_not_specialize: Sequence[str] = ()) -> None:
        unknown = sorted(set(do_not_specialize) - set(inspect.signature(fn).parameters))
        if unknown:
            raise ValueError(f"{fn.__name__}: do_not_specialize names unknown arguments {unknown}")
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self._compiled: dict[bool, Any] = {}
        self._binder: Callable[..., Any] | None = None

    @property
    def name(self) -> str:
        return self.fn.__name__

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        if not HAS_TRITON:
            raise RuntimeError(triton_unavailable_reason(torch.device("cuda")))
        mode = interpret_mode()
        if mode not in self._compiled:
            self._compiled[mode] = triton.jit(self.fn, do_not_specialize=self.do_not_specialize)
        launch = self._compiled[mode][grid]
        if not _compile_key_records:
            return launch

        def recorded_launch(*args: Any, **kwargs: Any) -> Any:
            key = self.compile_key(*args, **kwargs)
            for record in _compile_key_records:
                record.setdefault(self.name, set()).add(key)
            return launch(*args, **kwargs)

        return recorded_launch

    def compile_key(self, *args: Any, **kwargs: Any) -> str:
        """The key Triton compiles this kernel under for these launch arguments, as its
        compiled (not interpreted) launch computes it: constexpr values, argument types,
        the specialisations of integers (== 1, divisible by 16) and pointers (16-byte
        aligned), and launch options. Launches with equal keys share one binary."""
        if self._binder is None:
            from triton.backends.compiler import BaseBackend
            from triton.runtime.jit import JITFunction, create_function_from_signature

            jit = JITFunction(self.fn, do_not_specialize=self.do_not_specialize)
            self._binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        _, specialization, options = self._binder(*args, **kwargs)
        return f"{specialization}{options}"


_compile_key_records: list[dict[str, set[str]]] = []


@contextlib.contextmanager
def record_compile_keys() -> Iterator[dict[str, set[str]]]:
    """Collect {kernel name: set of `LazyKernel.compile_key`s} of the launches inside the
    block: the number of keys per kernel is the number of binaries Triton compiles for it
    (tests and benchmarks; it costs a key computation per launch while active)."""
    record: dict[str, set[str]] = {}
    _compile_key_records.append(record)
    try:
        yield record
    finally:
        _compile_key_records.remove(record)


def device_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A Triton device function (called from kernels) as a JITFunction in both modes.

    NOTE: not `triton.jit`, which follows TRITON_INTERPRET at decoration time: compiled
    kernels need a JITFunction, and the interpreter runs one as well, so one object serves
    both modes whatever the flag was at import.
    """
    return triton.runtime.jit.JITFunction(fn) if HAS_TRITON else fn


def lazy_jit(
    fn: Callable[..., None] | None = None, *, do_not_specialize: Sequence[str] = ()
) -> Any:
    """Decorator form of `LazyKernel`: `@lazy_jit` or `@lazy_jit(do_not_specialize=[...])`."""
    if fn is None:
        return functools.partial(LazyKernel, do_not_specialize=do_not_specialize)
    return LazyKernel(fn, do_not_specialize)


def cdiv(a: int, b: int) -> int:
    """Ceiling division, for launch grids on the host: `triton.cdiv` is a Triton constexpr
    function, whose host calls cost ~4 us each (0.2 here), and a prefill makes hundreds."""
    return -(-a // b)


def as_int8(flags: torch.Tensor) -> torch.Tensor:
    """Per-sequence flags as the int8 (0 / 1) the kernels read: a bool tensor's bytes are
    those already, so it is viewed (no conversion kernel in every layer's launch)."""
    return flags.view(torch.int8) if flags.dtype == torch.bool else flags.to(torch.int8)


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
    # A plain loop: this runs for every argument of every kernel launch of a prefill
    # (about 28 a layer), where a generator expression costs 2.5x as much host time.
    got = t.shape
    if len(got) == len(shape):
        for size, want in zip(got, shape):
            if want is not None and size != want:
                break
        else:
            return
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


def check_varlen_shapes(
    cu_seqlens: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor
) -> int:
    """Check the shapes of varlen metadata (not its values: no host sync); return S."""
    check_shape("state_slots", state_slots, [None])
    num_seqs = state_slots.shape[0]
    check_shape("cu_seqlens", cu_seqlens, [num_seqs + 1])
    check_shape("has_initial_state", has_initial_state, [num_seqs])
    return num_seqs


def check_varlen(
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_tokens: int,
    num_slots: int,
) -> list[tuple[int, int, int, bool]]:
    """Validate varlen metadata and return [(start, end, slot, has_init)] per sequence."""
    num_seqs = check_varlen_shapes(cu_seqlens, state_slots, has_initial_state)
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


def check_snapshot_shapes(
    snapshot_seqs: torch.Tensor | None,
    snapshot_lens: torch.Tensor | None,
    snapshot_slots: torch.Tensor | None,
) -> int:
    """Check the shapes of a scan's optional snapshot arguments (all three or none, [M]
    each); return M, 0 without snapshots."""
    given = [t is not None for t in (snapshot_seqs, snapshot_lens, snapshot_slots)]
    if not any(given):
        return 0
    if not all(given):
        raise ValueError(
            "snapshot_seqs, snapshot_lens and snapshot_slots go together; pass all three or none"
        )
    check_shape("snapshot_seqs", snapshot_seqs, [None])
    num = snapshot_seqs.shape[0]
    check_shape("snapshot_lens", snapshot_lens, [num])
    check_shape("snapshot_slots", snapshot_slots, [num])
    return num


def check_snapshots(
    snapshot_seqs: torch.Tensor | None,
    snapshot_lens: torch.Tensor | None,
    snapshot_slots: torch.Tensor | None,
    seqs: list[tuple[int, int, int, bool]],
    num_slots: int,
) -> dict[int, dict[int, int]]:
    """Validate snapshot arguments against `check_varlen`'s sequences; return
    {sequence: {tokens into it: slot}}."""
    by_seq: dict[int, dict[int, int]] = {}
    if check_snapshot_shapes(snapshot_seqs, snapshot_lens, snapshot_slots) == 0:
        return by_seq
    listed = zip(snapshot_seqs.tolist(), snapshot_lens.tolist(), snapshot_slots.tolist())
    used = {slot for _, _, slot, _ in seqs}
    for seq, length, slot in listed:
        if not 0 <= seq < len(seqs):
            raise ValueError(f"snapshot_seqs must lie in [0, {len(seqs)}), got {seq}")
        start, end, _, _ = seqs[seq]
        if not 1 <= length <= end - start:
            raise ValueError(
                f"snapshot_lens must lie in [1, {end - start}] for sequence {seq}, got {length}"
            )
        if not 0 <= slot < num_slots or slot in used:
            raise ValueError(
                f"snapshot_slots must be state rows in [0, {num_slots}) that no sequence "
                f"of the call uses, got {slot}"
            )
        by_seq.setdefault(seq, {})[length] = slot
    return by_seq


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def launch_config(
    op: str, default: dict[str, Any], override: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The launch parameters of one call: `default` with the entries of `override`.

    `override` is how benchmarks sweep and tests pin a kernel's launch parameters. Keys
    must be ones `default` has; block sizes, `n_inner` and `num_warps` must be powers of
    two, other counts positive integers, flags booleans; `maxnreg` may be None (no cap).
    """
    if not override:
        return dict(default)
    unknown = sorted(set(override) - set(default))
    if unknown:
        raise ValueError(
            f"{op}: unknown launch parameter(s) {unknown}; the known ones are {sorted(default)}"
        )
    for key, value in override.items():
        if isinstance(default[key], bool):
            ok, want = isinstance(value, bool), "a bool"
        elif key == "maxnreg" and value is None:
            ok, want = True, ""
        elif key.startswith("block") or key in ("n_inner", "num_warps"):
            ok = isinstance(value, int) and not isinstance(value, bool) and _is_pow2(value)
            want = "a power of two"
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            want = "a positive integer"
        if not ok:
            raise ValueError(f"{op}: launch parameter {key} must be {want}, got {value!r}")
    return {**default, **override}
