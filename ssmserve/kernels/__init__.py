"""Kernel ops: one Triton kernel and one PyTorch twin (`*_ref`) per op.

Use `get_ops(backend, device)` to pick an implementation set; the model code calls
ops only through the returned `KernelOps`, so the backend is one choice made once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# op field -> (module, function base name); the torch twin is `<name>_ref`, the
# Triton launcher `<name>_triton`, both with the same signature.
_OPS: dict[str, tuple[str, str]] = {
    "ssd_scan_varlen": ("ssd_scan", "ssd_scan_varlen"),
    "selective_scan_varlen": ("selective_scan", "selective_scan_varlen"),
    "selective_state_update": ("state_update", "selective_state_update"),
    "causal_conv1d_varlen": ("causal_conv1d", "causal_conv1d_varlen"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update"),
    "gated_rms_norm": ("gated_rms_norm", "gated_rms_norm"),
    "write_kv_cache": ("paged_attention", "write_kv_cache"),
    "paged_attention": ("paged_attention", "paged_attention"),
    "fused_moe": ("moe", "fused_moe"),
}

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class KernelOps:
    """The kernel implementations a model runs with (see each op's docstring)."""

    backend: str
    ssd_scan_varlen: Callable[..., torch.Tensor]
    selective_scan_varlen: Callable[..., torch.Tensor]
    selective_state_update: Callable[..., torch.Tensor]
    causal_conv1d_varlen: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map "auto" to "triton" on CUDA and "torch" elsewhere; validate the others."""
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def get_ops(backend: str, device: torch.device | str) -> KernelOps:
    """Return the op set for `backend` ("auto" | "triton" | "torch") on `device`.

    "triton" raises if Triton cannot run there (not installed, or CPU without
    TRITON_INTERPRET=1): there is no silent fallback to the twins.
    """
    # Imported here so `import ssmserve.kernels` does not import Triton.
    from ssmserve.kernels._common import triton_unavailable_reason

    device = torch.device(device)
    resolved = resolve_backend(backend, device)
    if resolved == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
    suffix = "_ref" if resolved == "torch" else "_triton"
    fns = {
        field: getattr(importlib.import_module(f"ssmserve.kernels.{module}"), name + suffix)
        for field, (module, name) in _OPS.items()
    }
    return KernelOps(backend=resolved, **fns)


__all__ = ["BACKENDS", "KernelOps", "get_ops", "resolve_backend"]
