"""Triton causal conv1d (varlen and update) against the PyTorch twins."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, cu_seqlens_of, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.causal_conv1d import (
    causal_conv1d_update_ref,
    causal_conv1d_update_triton,
    causal_conv1d_varlen_ref,
    causal_conv1d_varlen_triton,
)

pytestmark = requires_triton


def make(T, Cd, K, dtype, seed=0):
    gen = seeded(seed)
    return (
        randn(T, Cd, gen=gen, dtype=dtype).to(DEVICE),
        randn(Cd, K, gen=gen, dtype=dtype).to(DEVICE),
        randn(Cd, gen=gen, dtype=dtype).to(DEVICE),
        randn(6, Cd, K - 1, gen=gen, dtype=dtype).to(DEVICE),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("config", [None, {"block_t": 32, "block_c": 16}])
def test_varlen_matches_twin(dtype, K, varlen, init, config):
    """Tiles where rows reach back past their sequence's start (conv-state reads) and
    tiles wholly inside one sequence, at the default tile and at another."""
    lengths = [9, 1, 0, 2, 20, 70] if varlen else [23]
    slots = [4, 0, 1, 2, 3, 5] if varlen else [2]
    inits = [init, True, init, not init, init, True] if varlen else [init]
    x, w, b, pool = make(sum(lengths), 37, K, dtype)
    pool_ref = pool.clone()
    meta = dict(
        cu_seqlens=cu_seqlens_of(lengths).to(DEVICE),
        state_slots=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.tensor(inits, device=DEVICE),
    )
    y_ref = causal_conv1d_varlen_ref(x, w, b, conv_state=pool_ref, **meta)
    y = causal_conv1d_varlen_triton(x, w, b, conv_state=pool, config=config, **meta)
    assert_close(y, y_ref)
    assert torch.equal(pool, pool_ref)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("config", [None, {"block_c": 16, "num_warps": 2}])
def test_update_matches_twin(activation, with_bias, config):
    # config: 37 channels over three programs a row, the last one partly masked
    x, w, b, pool = make(4, 37, 4, torch.float32, seed=1)
    b = b if with_bias else None
    slots = torch.tensor([3, -1, 0, 4], device=DEVICE)
    pool_ref = pool.clone()
    y_ref = causal_conv1d_update_ref(x, pool_ref, w, b, state_slots=slots, activation=activation)
    y = causal_conv1d_update_triton(
        x, pool, w, b, state_slots=slots, activation=activation, config=config
    )
    assert_close(y, y_ref)
    assert torch.equal(pool, pool_ref)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
