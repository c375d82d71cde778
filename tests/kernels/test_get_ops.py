"""Backend selection (auto / triton / hopper / torch), its errors, and launch parameters."""

from __future__ import annotations

import pytest
import torch

from ssmserve.kernels import BACKENDS, KernelOps, get_ops, resolve_backend, ssd_scan_hopper
from ssmserve.kernels.paged_attention import decode_launch_config, prefill_launch_config
from ssmserve.kernels.selective_scan import scan_launch_config as selective_scan_launch_config
from ssmserve.kernels.ssd_scan import scan_launch_config, ssd_scan_varlen_ref
from ssmserve.kernels.ssd_scan_hopper import hopper_scan_usable, ssd_scan_varlen_hopper
from ssmserve.kernels.state_update import update_launch_config

OP_FIELDS = [f for f in KernelOps.__dataclass_fields__ if f not in ("backend", "pdl")]


def test_backends_are_the_documented_four():
    assert BACKENDS == ("auto", "triton", "hopper", "torch")


def test_torch_backend_returns_twins():
    ops = get_ops("torch", torch.device("cpu"))
    assert isinstance(ops, KernelOps) and ops.backend == "torch"
    assert ops.ssd_scan_varlen is ssd_scan_varlen_ref
    assert all(getattr(ops, f).__name__.endswith("_ref") for f in OP_FIELDS)


def test_auto_is_torch_on_cpu():
    assert resolve_backend("auto", "cpu") == "torch"
    assert get_ops("auto", "cpu").backend == "torch"


@pytest.mark.parametrize("usable,expected", [(True, "hopper"), (False, "triton")])
def test_auto_on_cuda_is_hopper_where_the_gluon_kernel_runs(monkeypatch, usable, expected):
    reason = None if usable else "not sm_90"
    monkeypatch.setattr(ssd_scan_hopper, "hopper_unavailable_reason", lambda device: reason)
    assert resolve_backend("auto", "cuda") == expected


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
    assert all(getattr(ops, f).__name__.endswith("_triton") for f in OP_FIELDS)


@pytest.mark.parametrize("device,interpret,match", [("cpu", "1", "interpreter"), ("cpu", "0", "")])
def test_hopper_where_it_cannot_run_is_an_error_saying_why(monkeypatch, device, interpret, match):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with pytest.raises(RuntimeError, match=f"hopper.*{match}"):
        get_ops("hopper", device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_hopper_without_a_gpu_is_an_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = ssd_scan_hopper.hopper_unavailable_reason(torch.device("cuda"))
    assert reason is not None and "hopper" in reason
    with pytest.raises(RuntimeError, match="hopper"):
        get_ops("hopper", "cuda")


def test_hopper_ops_are_triton_ops_with_the_gluon_ssd_scan(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(ssd_scan_hopper, "hopper_unavailable_reason", lambda device: None)
    ops = get_ops("hopper", "cuda")
    assert ops.backend == "hopper"
    assert ops.ssd_scan_varlen is ssd_scan_varlen_hopper
    triton_ops = [f for f in OP_FIELDS if f != "ssd_scan_varlen"]
    assert all(getattr(ops, f).__name__.endswith("_triton") for f in triton_ops)


def test_hopper_scan_refuses_a_device_it_cannot_run_on():
    x = torch.zeros(4, 2, 64)
    with pytest.raises(RuntimeError, match="hopper"):
        ssd_scan_varlen_hopper(
            x,
            torch.zeros(4, 2),
            -torch.ones(2),
            torch.zeros(4, 1, 64),
            torch.zeros(4, 1, 64),
            None,
            cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
            ssm_state=torch.zeros(1, 2, 64, 64),
            state_slots=torch.tensor([0]),
            has_initial_state=torch.tensor([False]),
        )


def _scan_tensors(dtype=torch.bfloat16, P=64, N=128, packed=True):
    """x, B, C, z, y, state as the Mamba2 mixer passes them (x, B, C views of one xBC)."""
    T, H, G = 40, 4, 1
    xbc = torch.zeros(T, H * P + 2 * G * N, dtype=dtype)
    x, B, C = xbc.split([H * P, G * N, G * N], dim=1)
    x, B, C = x.view(T, H, P), B.view(T, G, N), C.view(T, G, N)
    if not packed:
        x = torch.zeros(T, P, H, dtype=dtype).transpose(1, 2)  # heads not contiguous
    return x, B, C, torch.zeros(T, H, P, dtype=dtype), torch.empty(T, H, P, dtype=dtype)


@pytest.mark.parametrize(
    "change,usable",
    [
        ({}, True),
        ({"N": 64}, True),
        ({"dtype": torch.float16}, False),
        ({"dtype": torch.float32}, False),
        ({"P": 32}, False),
        ({"N": 16}, False),
        ({"packed": False}, False),
    ],
)
def test_gluon_kernel_takes_only_the_calls_it_supports(change, usable):
    x, B, C, z, y = _scan_tensors(**change)
    state = torch.zeros(3, x.shape[1], x.shape[2], B.shape[2])
    assert hopper_scan_usable(x, B, C, z, y, state, 256) is usable
    assert not hopper_scan_usable(x, B, C, z, y, state, 128), "256-token chunks only"


def test_launch_parameters_override_defaults_and_are_validated():
    default = scan_launch_config(torch.bfloat16, 256)
    assert scan_launch_config(torch.bfloat16, 256, {"block_p": 32}) == {**default, "block_p": 32}
    with pytest.raises(ValueError, match="unknown launch parameter"):
        scan_launch_config(torch.bfloat16, 256, {"chunk": 128})
    with pytest.raises(ValueError, match="power of two"):
        scan_launch_config(torch.bfloat16, 256, {"block": 48})
    with pytest.raises(ValueError, match="at most the chunk"):
        scan_launch_config(torch.bfloat16, 32, {"block": 64})
    with pytest.raises(ValueError, match="positive integer"):
        scan_launch_config(torch.float32, 256, {"num_stages": 0})
    with pytest.raises(ValueError, match="power of two"):
        update_launch_config(64, 128, {"block_p": 3})
    with pytest.raises(ValueError, match="bool"):
        selective_scan_launch_config(1, 64, 16, torch.device("cpu"), {"float_bc": 1})
    with pytest.raises(ValueError, match="query heads per KV head"):
        decode_launch_config(4, 8, 32, 128, 4096, torch.device("cpu"), {"block_m": 16})
    assert prefill_launch_config(4, 128, {"block_m": 64})["block_q"] == 16


def test_decode_defaults_skip_masks_only_with_one_stage():
    # Two loops cost a two-stage loop its pipelining (decode_launch_config's docstring):
    # the unmasked loop is the default only where splits are short enough for one stage.
    cpu = torch.device("cpu")
    for batch, context in [(1, 256), (1, 4096), (8, 4096), (64, 4096), (64, 32768)]:
        cfg = decode_launch_config(batch, 8, 4, 128, context, cpu)
        assert cfg["mask_skip"] == (cfg["num_stages"] == 1), (batch, context, cfg)
    assert decode_launch_config(1, 8, 4, 128, 256, cpu)["mask_skip"]
    assert not decode_launch_config(64, 8, 4, 128, 4096, cpu)["mask_skip"]
