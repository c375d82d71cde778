"""Backend selection: auto/torch/triton, and no silent fallback."""

from __future__ import annotations

import pytest
import torch

from ssmserve.kernels import KernelOps, get_ops, resolve_backend
from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref


def test_torch_backend_returns_twins():
    ops = get_ops("torch", torch.device("cpu"))
    assert isinstance(ops, KernelOps) and ops.backend == "torch"
    assert ops.ssd_scan_varlen is ssd_scan_varlen_ref


def test_auto_is_torch_on_cpu_and_triton_on_cuda():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    assert get_ops("auto", "cpu").backend == "torch"


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1|install"):
        get_ops("triton", "cpu")


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="kernel_backend"):
        get_ops("cuda", "cpu")


def test_triton_backend_with_interpreter_returns_triton_ops(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = get_ops("triton", "cpu")
    assert ops.backend == "triton"
    assert all(
        getattr(ops, f).__name__.endswith("_triton")
        for f in KernelOps.__dataclass_fields__
        if f != "backend"
    )
