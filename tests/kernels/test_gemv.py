"""The one-row GEMV of batch-1 decode (`decode_pdl`): the Triton kernel against F.linear
in float64, and what get_ops(pdl=True) asks of the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import PDL_OPS, get_ops
from ssmserve.kernels.activation import act_and_mul_ref
from ssmserve.kernels.gated_rms_norm import add_rms_norm_ref, gated_rms_norm_ref
from ssmserve.kernels.gemv import (
    act_mul_gemv_ref,
    act_mul_gemv_triton,
    add_norm_gemv_ref,
    add_norm_gemv_triton,
    gated_norm_gemv_ref,
    gated_norm_gemv_triton,
    gemv_launch_config,
    gemv_ref,
    gemv_triton,
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


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated, norm_before_gate", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize(
    "N, K, group, bias",
    [
        (37, 64, None, False),  # one group over four 16-wide K tiles
        (21, 96, 32, True),  # three groups of two tiles: each group's squares apart
        (9, 48, 16, False),  # groups of one tile
    ],
)
def test_gated_norm_gemv_matches_the_norm_then_the_linear(
    dtype, gated, norm_before_gate, N, K, group, bias
):
    """The fused kernel against the gated norm and the linear in float64 (the norm's
    value unrounded, as the kernel keeps it), and the reference op against its parts."""
    gen = seeded(1)
    x = randn(1, K, gen=gen, dtype=dtype).to(DEVICE)
    z = randn(1, K, gen=gen, dtype=dtype).to(DEVICE) if gated else None
    nw = (randn(K, gen=gen, dtype=dtype) * 0.5 + 1).to(DEVICE)
    w = randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    norm = dict(eps=1e-5, group_size=group, norm_before_gate=norm_before_gate)
    h = gated_rms_norm_ref(x.double(), nw.double(), None if z is None else z.double(), **norm)
    want = F.linear(h, w.double(), None if b is None else b.double())
    config = {"block_k": 16, "block_tile": 64}  # 4 rows a program
    got = gated_norm_gemv_triton(x, z, nw, w, b, **norm, config=config)
    assert got.shape == (1, N) and got.dtype == dtype
    assert_close(got, want)
    ref = gated_norm_gemv_ref(x, z, nw, w, b, **norm)
    assert torch.equal(ref, F.linear(gated_rms_norm_ref(x, nw, z, **norm), w, b))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "act, N, inter, bias, config",
    [
        ("silu", 37, 64, False, {"block_k": 16, "block_tile": 64}),  # 4 tiles, 4 rows
        ("gelu", 9, 40, True, None),  # no power of two from 16 divides: one masked tile
        ("gelu_pytorch_tanh", 21, 48, False, {"block_k": 16, "block_tile": 32}),
        ("relu", 5, 200, True, {"block_k": 64, "block_tile": 128}),  # the last tile masked
    ],
)
def test_act_mul_gemv_matches_act_and_mul_then_the_linear(dtype, act, N, inter, bias, config):
    """The fused kernel against PyTorch's act(gate) * up (rounded to the dtype, as the MLP
    passes it on) times the weight in float64, and the reference op against its parts."""
    gen = seeded(2)
    gate_up = randn(1, 2 * inter, gen=gen, dtype=dtype).to(DEVICE)
    w = randn(N, inter, gen=gen, dtype=dtype, scale=inter**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    h = act_and_mul_ref(gate_up, act=act)
    want = F.linear(h.double(), w.double(), None if b is None else b.double())
    got = act_mul_gemv_triton(gate_up, w, b, act=act, config=config)
    assert got.shape == (1, N) and got.dtype == dtype
    assert_close(got, want)
    assert torch.equal(act_mul_gemv_ref(gate_up, w, b, act=act), F.linear(h, w, b))
    with pytest.raises(ValueError, match="weight must have shape"):
        act_mul_gemv_ref(gate_up, w[:, 1:], b, act=act)


@requires_triton
@pytest.mark.parametrize(
    "dtype, residual_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                              (torch.bfloat16, torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize(
    "N, K, bias, config",
    [
        (37, 64, False, {"block_k": 16, "block_tile": 64}),  # 4 tiles, 4 rows a program
        (9, 48, True, None),  # one tile of 16 x 3
        (21, 40, False, None),  # no power of two from 16 divides 40: the two ops
    ],
)
def test_add_norm_gemv_matches_the_add_the_norm_then_the_linear(
    dtype, residual_dtype, N, K, bias, config
):
    """The fused kernel against residual + x, rounded as add_rms_norm rounds it, normed
    and multiplied in float64 (the norm's value unrounded, as the kernel keeps it); the
    new residual (bit for bit on a GPU); the residual passed in untouched; and the reference op
    against its parts."""
    gen = seeded(3)
    x = randn(1, K, gen=gen, dtype=dtype).to(DEVICE)
    residual = randn(1, K, gen=gen, dtype=residual_dtype, scale=4.0).to(DEVICE)
    before = residual.clone()
    nw = (randn(K, gen=gen, dtype=dtype) * 0.5 + 1).to(DEVICE)
    w = randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    s = (residual.double() + x.double()).to(residual_dtype)
    h = s.to(dtype).double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    want = F.linear(h, w.double(), None if b is None else b.double())
    got, got_s = add_norm_gemv_triton(x, residual, nw, w, b, eps=1e-5, config=config)
    assert got.shape == (1, N) and got.dtype == dtype
    assert_close(got, want)
    # Exact on a GPU; the interpreter truncates float32 -> bfloat16 where GPUs round.
    if DEVICE.type == "cuda" or residual_dtype == torch.float32:
        assert torch.equal(got_s, s)
    assert_close(got_s, s)
    assert torch.equal(residual, before)
    ref, ref_s = add_norm_gemv_ref(x, residual, nw, w, b, eps=1e-5)
    normed, parts_s = add_rms_norm_ref(x, residual, nw, eps=1e-5)
    assert torch.equal(ref, F.linear(normed, w, b)) and torch.equal(ref_s, parts_s)


@requires_triton
def test_fused_gemvs_at_model_widths_with_default_tiles():
    """The fused kernels with their default tiles at real widths (Mamba2-2.7B's out_proj
    K = 5120 and in_proj K = 2560, Llama-3-8B's down K = 14336; few rows, to stay cheap in
    the interpreter) against float64: every K tile of a 1024- or 4096-wide walk."""
    gen = seeded(4)
    dtype = torch.bfloat16

    def rand(*shape, scale=1.0):
        return randn(*shape, gen=gen, dtype=dtype, scale=scale).to(DEVICE)

    y, nw, w = rand(1, 5120), rand(5120) * 0.5 + 1, rand(24, 5120, scale=5120**-0.5)
    want = F.linear(gated_rms_norm_ref(y.double(), nw.double(), eps=1e-5), w.double())
    assert_close(gated_norm_gemv_triton(y, None, nw, w, eps=1e-5), want)
    x, r, nw, w = rand(1, 2560), rand(1, 2560), rand(2560) * 0.5 + 1, rand(40, 2560)
    normed, _ = add_rms_norm_ref(x.double(), r.double(), nw.double(), eps=1e-5)
    assert_close(add_norm_gemv_triton(x, r, nw, w * 2560**-0.5, eps=1e-5)[0],
                 F.linear(normed, (w * 2560**-0.5).double()))  # fmt: skip
    gate_up, w = rand(1, 2 * 14336), rand(8, 14336, scale=14336**-0.5)
    h = act_and_mul_ref(gate_up, act="silu").double()
    assert_close(act_mul_gemv_triton(gate_up, w, act="silu"), F.linear(h, w.double()))


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
def test_fused_gemvs_need_decode_pdl():
    from ssmserve import LLM

    with pytest.raises(RuntimeError, match="decode_fused_gemv .*without --decode-fused-gemv"):
        LLM("ssmserve-bamba-tiny", decode_fused_gemv=True)


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
