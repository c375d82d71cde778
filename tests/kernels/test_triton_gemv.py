"""Triton GEMV against its PyTorch twin (F.linear) and a float64 product (interpreter on
CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels._common import record_compile_keys
from ssmserve.kernels.gemv import MAX_ROWS, gemv_launch_config, gemv_ref, gemv_triton

pytestmark = requires_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gemv_inputs(M, N, K, dtype, bias, seed=0, row_stride=None):
    """x [M, K] (a view with row stride `row_stride` when given), weight [N, K], bias."""
    gen = seeded(seed)
    if row_stride is None:
        x = randn(M, K, gen=gen, dtype=dtype).to(DEVICE)
    else:
        x = randn(M, row_stride, gen=gen, dtype=dtype).to(DEVICE)[:, 3 : 3 + K]
    w = randn(N, K, gen=gen, dtype=dtype, scale=K**-0.5).to(DEVICE)
    b = randn(N, gen=gen, dtype=dtype).to(DEVICE) if bias else None
    return x, w, b


def check(x, w, b, config=None):
    out = gemv_triton(x, w, b, config=config)
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype
    truth = x.double() @ w.double().T + (0 if b is None else b.double())
    assert_close(out, truth, dtype=x.dtype, msg="against float64")
    assert_close(out, gemv_ref(x, w, b), dtype=x.dtype, msg="against F.linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_at_odd_sizes(dtype, M, bias):
    # N and K not powers of two nor multiples of the tiles: masked rows and a K tail.
    check(*gemv_inputs(M, 45, 83, dtype, bias), config={"block_n": 16, "block_k": 32})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [2, 3, 16])
def test_split_k_matches_f_linear(dtype, split_k):
    """K split over programs (16 splits: more than the K tiles, so the count shrinks)."""
    check(*gemv_inputs(3, 40, 150, dtype, True), config={"block_k": 32, "split_k": split_k})


@pytest.mark.parametrize("bias", [False, True])
def test_default_launch_splits_k_where_rows_are_few(bias):
    x, w, b = gemv_inputs(2, 20, 1100, torch.float32, bias)
    assert gemv_launch_config(20, 1100, 2, torch.float32, x.device)["split_k"] > 1
    check(x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_view_of_a_wider_tensor(dtype):
    """x as a model slices it: a view with a row stride wider than K."""
    x, w, b = gemv_inputs(3, 33, 70, dtype, True, row_stride=90)
    assert not x.is_contiguous() and x.stride(1) == 1
    check(x, w, b, config={"block_n": 16, "block_k": 16})


def test_every_row_count_up_to_the_maximum_gives_the_same_rows():
    """A row's result does not depend on how many rows come with it (batch invariance)."""
    x, w, b = gemv_inputs(MAX_ROWS, 24, 40, torch.bfloat16, True)
    full = gemv_triton(x, w, b)
    for M in (1, 2, 5):
        assert torch.equal(gemv_triton(x[:M], w, b), full[:M])
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        gemv_ref(torch.zeros(MAX_ROWS + 1, 40), w.float())
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        gemv_triton(torch.zeros(MAX_ROWS + 1, 40, device=DEVICE), w.float())


def test_empty_inputs():
    w = torch.ones(8, 5, device=DEVICE)
    assert gemv_triton(torch.zeros(0, 5, device=DEVICE), w).shape == (0, 8)
    b = torch.arange(8.0, device=DEVICE)
    out = gemv_triton(torch.zeros(2, 0, device=DEVICE), torch.zeros(8, 0, device=DEVICE), b)
    assert torch.equal(out, b.expand(2, 8))


def test_argument_errors_say_what_is_wrong():
    x, w = torch.zeros(2, 16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="one dtype"):
        gemv_triton(x, w.half())
    with pytest.raises(ValueError, match="shape"):
        gemv_triton(x, torch.zeros(8, 12))
    with pytest.raises(ValueError, match="columns contiguous"):
        gemv_triton(x, torch.zeros(16, 8).T)


def test_launch_parameters_are_validated():
    cpu = torch.device("cpu")
    default = gemv_launch_config(64, 256, 1, torch.bfloat16, cpu)
    assert set(default) == {"block_n", "block_k", "split_k", "num_warps", "num_stages"}
    assert gemv_launch_config(64, 256, 1, torch.bfloat16, cpu, {"split_k": 3})["split_k"] == 3
    with pytest.raises(ValueError, match="unknown launch parameter"):
        gemv_launch_config(64, 256, 1, torch.bfloat16, cpu, {"block_m": 16})
    with pytest.raises(ValueError, match="power of two"):
        gemv_launch_config(64, 256, 1, torch.bfloat16, cpu, {"block_n": 48})
    with pytest.raises(ValueError, match="at least 16"):
        gemv_launch_config(64, 256, 1, torch.bfloat16, cpu, {"block_k": 8})
    with pytest.raises(ValueError, match="positive integer"):
        gemv_launch_config(64, 256, 1, torch.bfloat16, cpu, {"split_k": 0})
    # The defaults follow the weight's shape, never the rows (batch invariance).
    assert all(gemv_launch_config(64, 256, M, torch.bfloat16, cpu) == default for M in (2, 4))


def test_shapes_of_any_batch_share_one_kernel():
    """Rows 1 to 9 and layers of different N and K: one compile per path (split or not,
    bias or not), none per shape."""
    with record_compile_keys() as keys:
        for M in (1, 2, 3, 5, 9):
            for N, K in ((48, 64), (33, 80)):
                x, w, b = gemv_inputs(M, N, K, torch.float32, True)
                gemv_triton(x, w, b, config={"block_n": 16, "block_k": 16})
                gemv_triton(x, w, None, config={"block_n": 16, "block_k": 16, "split_k": 2})
    assert len(keys["_gemv_kernel"]) == 2
    assert len(keys["_gemv_split_sum_kernel"]) == 1
