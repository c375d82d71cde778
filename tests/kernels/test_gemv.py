"""The one-row GEMV of batch-1 decode (`decode_pdl`): the Triton kernel against F.linear
in float64, and what get_ops(pdl=True) asks of the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import PDL_OPS, get_ops
from ssmserve.kernels.gated_rms_norm import add_rms_norm_triton
from ssmserve.kernels.gemv import (
    add_rms_norm_gemv_ref,
    add_rms_norm_gemv_triton,
    gated_rms_norm_gemv_ref,
    gated_rms_norm_gemv_triton,
    gemv_launch_config,
    gemv_ref,
    gemv_triton,
    norm_gemv_launch_config,
)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "N, K, config",
    [
        (37, 48, None),  # block_k 16 divides K: unmasked tiles
        (37, 40, None),  # no power of two from 16 divides K: one masked tile
        (37, 48, {"block_tile": 64}),  # 4 rows a program, N not a multiple: a partial tile
        (5, 200, {"block_k": 64, "block_tile": 128}),  # 2 rows, 4 K tiles, the last masked
    ],
)
def test_triton_matches_float64_linear(dtype, bias, N, K, config):
    gen = seeded(0)
    x = randn(1, K, gen=gen, dtype=dtype).to(DEVICE)
    w = randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = gemv_triton(x, w, b, config=config)
    assert got.shape == (1, N) and got.dtype == dtype
    assert_close(got, want)
    assert_close(gemv_ref(x, w, b), want)


def test_launch_config_picks_a_dividing_tile_and_enough_programs():
    cpu = torch.device("cpu")  # stands in for a GPU of 2 SMs: at least 4 programs
    assert gemv_launch_config(4096, 2560, cpu)["block_k"] == 512  # 2560 = 5 x 512
    assert gemv_launch_config(4096, 14336, cpu)["block_k"] == 2048  # 7 x 2048
    cfg = gemv_launch_config(4096, 4096, cpu)
    assert cfg["block_k"] == 4096 and cfg["block_n"] == 2
    assert gemv_launch_config(4096, 40, cpu)["block_k"] == 64  # none divides: one masked
    # 16 rows of 512 a program would make 1 program of all 12 rows: halved to 2, 6 programs
    narrow = gemv_launch_config(12, 512, cpu)
    assert narrow["block_n"] == 2 and -(-12 // narrow["block_n"]) >= 4
    # Under six programs an SM (12 here), half the rows: 4 programs of 16 become 8 of 8;
    # a block_tile given is taken as it is.
    assert gemv_launch_config(64, 512, cpu)["block_n"] == 8
    assert gemv_launch_config(64, 512, cpu, {"block_tile": 8192})["block_n"] == 16
    with pytest.raises(ValueError, match="power of two"):
        gemv_launch_config(64, 64, cpu, {"block_tile": 100})


def test_bad_arguments_are_refused():
    w = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="x must have shape"):
        gemv_ref(torch.zeros(2, 4), w)
    with pytest.raises(ValueError, match="share one dtype"):
        gemv_ref(torch.zeros(1, 4), w.double())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_pdl_ops_need_a_gpu_and_the_triton_kernels():
    with pytest.raises(RuntimeError, match="decode_pdl: .*CUDA GPU.*without --decode-pdl"):
        get_ops("torch", "cpu", pdl=True)
    # The default (None) turns PDL on only where it can run: here, silently off.
    assert not get_ops("torch", "cpu", pdl=None).pdl
    assert set(PDL_OPS) <= set(get_ops("torch", "cpu").__dataclass_fields__)


def test_pdl_ops_launch_with_pdl_only_inside_pdl_scope():
    """A PDL op launches with pdl=True only inside `pdl_scope()` (DecodeGraphs holds it
    over warm-up and capture); outside, it is its eager form (the GEMV's: F.linear), so
    eager steps launch what they would without PDL. Scopes nest and restore."""
    from ssmserve.kernels import _pdl_in_scope, pdl_scope

    calls = []
    op = _pdl_in_scope(
        lambda *a, pdl=False: calls.append(("pdl", pdl)), lambda *a: calls.append("eager")
    )
    op()
    with pdl_scope():
        op()
        with pdl_scope():
            op()
        op()
    op()
    assert calls == ["eager", ("pdl", True), ("pdl", True), ("pdl", True), "eager"]


def _rms_norm64(h, norm_weight, group):
    """The RMSNorm of float64 h over groups of `group` columns, times the weight."""
    g = h.view(h.shape[0], -1, group)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)
    return g.view_as(h) * norm_weight.double()


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "K, group, gate, bias, config",
    [
        (64, None, "after", False, None),  # one group, one tile
        (96, 48, "after", True, {"block_k": 16}),  # 2 groups of 3 tiles
        (96, 32, "before", False, {"block_k": 16, "block_tile": 64}),  # 4 rows, N partial
        (64, 32, None, True, None),  # no gate: a plain grouped RMSNorm
        (40, None, "after", True, None),  # no tile of 16+ divides 40: norm, then GEMV
    ],
)
def test_gated_norm_gemv_matches_float64(dtype, K, group, gate, bias, config):
    """The norm inside the GEMV against the norm and the linear in float64, and the
    twin (which rounds the normalised row to dtype first) against the same."""
    gen = seeded(1)
    N = 37
    x = randn(1, K, gen=gen, dtype=dtype).to(DEVICE)
    z = randn(1, K, gen=gen, dtype=dtype).to(DEVICE) if gate else None
    nw = (1 + randn(K, gen=gen, scale=0.2)).to(dtype).to(DEVICE)
    w = randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    h = x.double()
    g = None if z is None else F.silu(z.double())
    if g is not None and gate == "after":
        h = h * g
    h = _rms_norm64(h, nw, group or K)
    if g is not None and gate == "before":
        h = h * g
    want = F.linear(h, w.double(), None if b is None else b.double())
    kw = dict(norm_weight=nw, z=z, eps=1e-5, group_size=group, norm_before_gate=gate == "before")
    got = gated_rms_norm_gemv_triton(x, w, b, config=config, **kw)
    assert got.shape == (1, N) and got.dtype == dtype
    assert_close(got, want)
    assert_close(gated_rms_norm_gemv_ref(x, w, b, **kw), want)


@requires_triton
@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "K, bias, config", [(64, False, None), (96, True, {"block_k": 32, "block_tile": 64})]
)
def test_add_norm_gemv_matches_float64_and_stores_the_sum(residual_dtype, K, bias, config):
    """The residual add, the pre-norm and the linear: the sum is the one add_rms_norm's
    kernel stores (the add rounded to the residual's dtype; Triton's interpreter rounds
    float32 to bfloat16 toward zero, so on CPU the two kernels are compared bit for bit
    and the sum with the exact one within the dtype's tolerance), and the product is the
    norm of it (as the norm reads it, in the weight's dtype) times W, in float64."""
    gen = seeded(2)
    N, dtype = 29, torch.bfloat16
    x = randn(1, K, gen=gen, dtype=dtype).to(DEVICE)
    residual = randn(1, K, gen=gen, dtype=residual_dtype, scale=3.0).to(DEVICE)
    nw = (1 + randn(K, gen=gen, scale=0.2)).to(dtype).to(DEVICE)
    w = randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    s_want = (residual.double() + x.double()).to(residual_dtype)
    h = _rms_norm64(s_want.to(dtype).double(), nw, K)
    want = F.linear(h, w.double(), None if b is None else b.double())
    kw = dict(residual=residual, norm_weight=nw, eps=1e-5)
    got, s = add_rms_norm_gemv_triton(x, w, b, config=config, **kw)
    assert got.shape == (1, N) and got.dtype == dtype
    assert s.dtype == residual_dtype
    assert torch.equal(s, add_rms_norm_triton(x, residual, nw, eps=1e-5)[1])
    assert_close(s, s_want)
    assert_close(got, want)
    got_ref, s_ref = add_rms_norm_gemv_ref(x, w, b, **kw)
    assert torch.equal(s_ref.cpu(), s_want.cpu())
    assert_close(got_ref, want)


def test_norm_gemv_tiles_divide_the_norm_group():
    cpu = torch.device("cpu")
    cfg = norm_gemv_launch_config(2560, 5120, cpu)  # Mamba2-2.7B's out_proj: one group
    assert cfg["block_k"] == 1024 and cfg["block_n"] >= 4
    assert norm_gemv_launch_config(4096, 4096 // 8, cpu)["block_k"] == 512  # 8 groups
    assert norm_gemv_launch_config(64, 48, cpu)["block_k"] == 16
    assert norm_gemv_launch_config(64, 40, cpu) is None  # no tile of 16 or more divides
    assert norm_gemv_launch_config(64, 96, cpu, {"block_k": 64}) is None
