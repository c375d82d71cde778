"""The one-row GEMV of batch-1 decode (`decode_pdl`): the Triton kernel against F.linear
in float64, and what get_ops(pdl=True) asks of the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import PDL_OPS, get_ops
from ssmserve.kernels.activation import ACTIVATIONS, act_and_mul_ref, act_and_mul_triton
from ssmserve.kernels.gemv import (
    gemv_act_and_mul_ref,
    gemv_act_and_mul_triton,
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
        (301, 2560, {"block_k": 512, "block_tile": 4096}),  # 5 K tiles, a partial row block
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
@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a != "swish"])
@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize(
    "inter, K, config",
    [
        (37, 48, None),  # 16 rows (8 pairs) a program, the last block partial
        (19, 40, {"block_tile": 64}),  # 4 rows a program, one masked K tile
        (5, 200, {"block_k": 64, "block_tile": 128}),  # one pair a program, 4 K tiles
        (3, 64, {"block_k": 64, "block_tile": 64}),  # the GEMV's one row: a pair here
    ],
)
def test_gated_gemv_is_act_and_mul_of_the_gemv(act, dtype, bias, inter, K, config):
    """gemv_act_and_mul: act(gate) * up of the [2I, K] weight's GEMV, every output bit
    for bit what the GEMV then act_and_mul give at the same tile shape (a gate row and
    its up row paired in one tile), and close to the float64 reference."""
    gen = seeded(1)
    x = randn(1, K, gen=gen, dtype=dtype).to(DEVICE)
    w = randn(2 * inter, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(2 * inter, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    got = gemv_act_and_mul_triton(x, w, b, act=act, config=config)
    assert got.shape == (1, inter) and got.dtype == dtype
    if gemv_launch_config(2 * inter, K, x.device, config)["block_n"] >= 2:  # same tiles
        unfused = act_and_mul_triton(gemv_triton(x, w, b, config=config), act=act)
        assert torch.equal(got, unfused)
    f64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_close(got, act_and_mul_ref(f64, act=act))
    assert_close(gemv_act_and_mul_ref(x, w, b, act=act), act_and_mul_ref(f64, act=act))


@requires_triton
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N, K", [(37, 40), (301, 2560)])
def test_float32_out_is_the_bf16_result_cast(bias, N, K):
    """out_dtype=float32 (an LM head's logits): every value the bf16 GEMV's, bit for bit,
    widened to float32 (rounded to bf16 first, as F.linear then .float() give), from the
    Triton kernel and from the twin; and not the float32 sum left unrounded."""
    gen = seeded(2)
    x = randn(1, K, gen=gen, dtype=torch.bfloat16).to(DEVICE)
    w = randn(N, K, gen=gen, dtype=torch.bfloat16, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=torch.bfloat16).to(DEVICE) if bias else None
    got = gemv_triton(x, w, b, out_dtype=torch.float32)
    assert got.shape == (1, N) and got.dtype == torch.float32
    assert torch.equal(got, gemv_triton(x, w, b).float())
    assert torch.equal(got.bfloat16().float(), got)  # every value a bf16 value
    want = gemv_ref(x, w, b, out_dtype=torch.float32)
    assert want.dtype == torch.float32 and torch.equal(want, F.linear(x, w, b).float())
    assert_close(got.bfloat16(), want.bfloat16())  # the sums in another order
    unrounded = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert not torch.equal(got, unrounded)


def test_gated_gemv_refuses_what_act_and_mul_refuses():
    with pytest.raises(ValueError, match="act_and_mul supports"):
        gemv_act_and_mul_ref(torch.zeros(1, 4), torch.zeros(6, 4), act="tanh")
    with pytest.raises(ValueError, match="must be even"):
        gemv_act_and_mul_ref(torch.zeros(1, 4), torch.zeros(5, 4), act="silu")


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
