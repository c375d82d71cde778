"""Kernel ops: one Triton kernel and one PyTorch twin (`*_ref`) per op.

Use `get_ops(backend, device)` to pick an implementation set; the model code calls
ops only through the returned `KernelOps`, so the backend is one choice made once.
The Triton launchers (`*_triton`) also take launch parameters (`config=`, and
`decode_config=` / `prefill_config=` for paged attention) that override their tuned
defaults: benchmarks sweep them and tests pin them; the model code never passes them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: BACKENDS must be cheap to import
    import torch

# op field -> (module, function base name); the torch twin is `<name>_ref`, the
# Triton launcher `<name>_triton`, both with the same signature.
_OPS: dict[str, tuple[str, str]] = {
    "ssd_scan_varlen": ("ssd_scan", "ssd_scan_varlen"),
    "selective_scan_varlen": ("selective_scan", "selective_scan_varlen"),
    "selective_state_update": ("state_update", "selective_state_update"),
    "causal_conv1d_varlen": ("causal_conv1d", "causal_conv1d_varlen"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update"),
    "mamba2_decode_update": ("mamba2_decode", "mamba2_decode_update"),
    "gated_rms_norm": ("gated_rms_norm", "gated_rms_norm"),
    "add_rms_norm": ("gated_rms_norm", "add_rms_norm"),
    "embed_rms_norm": ("gated_rms_norm", "embed_rms_norm"),
    "rotary_embedding": ("rotary", "rotary_embedding"),
    "rotary_decode_attention": ("rotary", "rotary_decode_attention"),
    "act_and_mul": ("activation", "act_and_mul"),
    "write_kv_cache": ("paged_attention", "write_kv_cache"),
    "paged_attention": ("paged_attention", "paged_attention"),
    "merge_attention_parts": ("attention_merge", "merge_attention_parts"),
    "moe_route": ("moe", "moe_route"),
    "fused_moe": ("moe", "fused_moe"),
    "gemv": ("gemv", "gemv"),
    "gemv_act_and_mul": ("gemv", "gemv_act_and_mul"),
}
# Ops whose launchers take `pdl` (programmatic dependent launch, `get_ops(pdl=True)`):
# the Triton kernels of a batch-1 decode step of the dense families (not `embed_rms_norm`,
# a graph's first kernel, after one outside the graph). They launch so only inside
# `pdl_scope()`, which DecodeGraphs holds over the warm-up and capture of its graphs:
# launched eagerly (prefill), PDL cost host time, a Mamba2-2.7B 2k prompt's TTFT 52.5 ->
# 87.7 ms on an H100 (docs/kernels.md); eagerly the one-row linears run F.linear.
PDL_OPS = (
    "gemv",
    "add_rms_norm",
    "gated_rms_norm",
    "mamba2_decode_update",
    "causal_conv1d_update",
    "selective_state_update",
    "rotary_embedding",
    "rotary_decode_attention",
    "write_kv_cache",
    "paged_attention",
    "act_and_mul",
    "gemv_act_and_mul",
)
# What "hopper" runs instead of the Triton-language op: field -> (module, function).
_HOPPER_OPS: dict[str, tuple[str, str]] = {
    "ssd_scan_varlen": ("ssd_scan_hopper", "ssd_scan_varlen_hopper"),
}

BACKENDS = ("auto", "triton", "hopper", "torch")


@dataclass(frozen=True)
class KernelOps:
    """The kernel implementations a model runs with (see each op's docstring).

    `backend` is the resolved choice: "torch", "triton" or "hopper" (never "auto");
    `pdl` whether the PDL_OPS launch with programmatic dependent launch (inside
    `pdl_scope()`: in captured CUDA graphs).
    """

    backend: str
    ssd_scan_varlen: Callable[..., torch.Tensor]
    selective_scan_varlen: Callable[..., torch.Tensor]
    selective_state_update: Callable[..., torch.Tensor]
    causal_conv1d_varlen: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    mamba2_decode_update: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    embed_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_decode_attention: Callable[..., torch.Tensor]
    act_and_mul: Callable[..., torch.Tensor]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    merge_attention_parts: Callable[..., torch.Tensor]
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
    gemv: Callable[..., torch.Tensor]
    gemv_act_and_mul: Callable[..., torch.Tensor]
    pdl: bool = False


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map "auto" to a concrete backend for `device`; validate the others.

    "auto" is "torch" off CUDA, and on CUDA "hopper" where the Gluon SSD kernel can run
    (an sm_90 GPU, Triton with Gluon) and "triton" elsewhere.
    """
    import torch

    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    # Imported here so `import ssmserve.kernels` does not import Triton.
    from ssmserve.kernels.ssd_scan_hopper import hopper_unavailable_reason

    return "hopper" if hopper_unavailable_reason(device) is None else "triton"


def get_ops(backend: str, device: torch.device | str, pdl: bool | None = False) -> KernelOps:
    """Return the op set for `backend` (one of BACKENDS) on `device`; with `pdl` the
    PDL_OPS launch with programmatic dependent launch (Triton kernels on sm_90 only);
    `pdl=None` turns it on wherever it can run.

    - "torch": the PyTorch twins, on any device.
    - "triton": the portable Triton-language kernels for every op, on CUDA, or on CPU
      under TRITON_INTERPRET=1 (slow; for tests).
    - "hopper": "triton" with the Gluon SSD scan kernel of ssd_scan_hopper.py, for sm_90
      GPUs (H100/H200). Calls it cannot take (dtypes other than bf16, head dims other
      than 64, state dims other than 64/128, chunks other than 256, strides TMA cannot
      address) run the Triton-language SSD kernel: see `hopper_scan_usable`.
    - "auto": see `resolve_backend`.

    A backend that cannot run on `device` raises, saying why: there is no silent
    fallback to another backend.
    """
    # Imported here so `import ssmserve.kernels` imports neither torch nor Triton.
    import torch

    from ssmserve.kernels._common import triton_unavailable_reason

    device = torch.device(device)
    resolved = resolve_backend(backend, device)
    if resolved in ("triton", "hopper"):
        reason = triton_unavailable_reason(device, resolved)
        if reason is not None:
            raise RuntimeError(reason)
    if resolved == "hopper":
        from ssmserve.kernels.ssd_scan_hopper import hopper_unavailable_reason

        reason = hopper_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
    suffix = "_ref" if resolved == "torch" else "_triton"
    targets = {field: (module, name + suffix) for field, (module, name) in _OPS.items()}
    if resolved == "hopper":
        targets.update(_HOPPER_OPS)
    fns = {
        field: getattr(importlib.import_module(f"ssmserve.kernels.{module}"), name)
        for field, (module, name) in targets.items()
    }
    if pdl is not False:
        from ssmserve.kernels._common import pdl_unavailable_reason

        reason = pdl_unavailable_reason(device)
        if reason is None and resolved == "torch":
            reason = "kernel_backend 'torch' has no Triton launches to chain"
        if pdl is None:
            pdl = reason is None
        elif reason is not None:
            raise RuntimeError(f"decode_pdl: {reason}; run without --decode-pdl")
    if pdl:
        from ssmserve.kernels.gemv import gemv_act_and_mul_ref, gemv_ref

        # Eagerly, one-row linears stay with cuBLAS (F.linear): the GEMV pays off only
        # chained with PDL.
        eager_refs = {"gemv": gemv_ref, "gemv_act_and_mul": gemv_act_and_mul_ref}
        for field in PDL_OPS:
            eager = eager_refs.get(field, fns[field])
            fns[field] = _pdl_in_scope(fns[field], eager)
    return KernelOps(backend=resolved, pdl=bool(pdl), **fns)


_pdl_active = threading.local()


@contextlib.contextmanager
def pdl_scope() -> Iterator[None]:
    """Inside it, the PDL_OPS of a `get_ops(pdl=True)` set launch with PDL. Hold it over
    a graph's warm-up as well as its capture: the PDL variants of the kernels must
    compile before the capture (loading a module inside one invalidates it)."""
    before = getattr(_pdl_active, "on", False)
    _pdl_active.on = True
    try:
        yield
    finally:
        _pdl_active.on = before


def _pdl_in_scope(fn: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with pdl=True inside `pdl_scope()`, else `eager`."""

    @functools.wraps(fn)
    def launch(*args: Any, **kwargs: Any) -> Any:
        if getattr(_pdl_active, "on", False):
            return fn(*args, pdl=True, **kwargs)
        return eager(*args, **kwargs)

    return launch


__all__ = ["BACKENDS", "PDL_OPS", "KernelOps", "get_ops", "pdl_scope", "resolve_backend"]
