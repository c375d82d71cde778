"""Triton one-token state update against its PyTorch twin (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.state_update import (
    selective_state_update_ref,
    selective_state_update_triton,
)

pytestmark = requires_triton


def mamba2_args(Bt, H, P, G, N, dtype, state_dtype, seed=0, with_dz=True):
    gen = seeded(seed)
    pool = randn(6, H, P, N, gen=gen, dtype=state_dtype).to(DEVICE)
    args = dict(
        x=randn(Bt, H, P, gen=gen, dtype=dtype).to(DEVICE),
        dt=randn(Bt, H, gen=gen, dtype=dtype).to(DEVICE)[:, :, None].expand(Bt, H, P),
        A=(-torch.exp(randn(H, gen=gen))).to(DEVICE)[:, None, None].expand(H, P, N),
        B=randn(Bt, G, N, gen=gen, dtype=dtype).to(DEVICE),
        C=randn(Bt, G, N, gen=gen, dtype=dtype).to(DEVICE),
        D=randn(H, gen=gen).to(DEVICE)[:, None].expand(H, P) if with_dz else None,
        z=randn(Bt, H, P, gen=gen, dtype=dtype).to(DEVICE) if with_dz else None,
        dt_bias=randn(H, gen=gen).to(DEVICE)[:, None].expand(H, P) if with_dz else None,
    )
    return pool, args


def compare(pool, args, slots, **kw):
    slots = torch.tensor(slots, device=DEVICE)
    pool_ref = pool.clone()
    y_ref = selective_state_update_ref(pool_ref, **args, state_slots=slots, **kw)
    y = selective_state_update_triton(pool, **args, state_slots=slots, **kw)
    assert_close(y, y_ref, msg="y")
    assert_close(pool, pool_ref, msg="state pool")
    assert torch.equal(y[slots < 0], torch.zeros_like(y[slots < 0]))


@pytest.mark.parametrize("H,P,G,N", [(3, 5, 1, 6), (4, 16, 2, 16)])
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_mamba2_layout_matches_twin(H, P, G, N, dtype, state_dtype):
    pool, args = mamba2_args(4, H, P, G, N, dtype, state_dtype)
    pool_before = pool.clone()
    compare(pool, args, [4, -1, 0, 2], dt_limit=(0.01, 2.0))
    assert torch.equal(pool[[1, 3, 5]], pool_before[[1, 3, 5]])


def test_mamba2_without_d_z_bias():
    pool, args = mamba2_args(2, 3, 5, 1, 6, torch.float32, torch.float32, with_dz=False)
    compare(pool, args, [1, 0], dt_softplus=False)


def test_mamba1_layout_untied_matches_twin():
    gen = seeded(1)
    Bt, Dm, N = 3, 9, 5
    pool = randn(4, Dm, N, gen=gen).to(DEVICE)
    args = dict(
        x=randn(Bt, Dm, 1, gen=gen).to(DEVICE),
        dt=randn(Bt, Dm, 1, gen=gen).to(DEVICE),
        A=(-torch.exp(randn(Dm, 1, N, gen=gen))).to(DEVICE),
        B=randn(Bt, 1, N, gen=gen).to(DEVICE),
        C=randn(Bt, 1, N, gen=gen).to(DEVICE),
        D=randn(Dm, 1, gen=gen).to(DEVICE),
        z=randn(Bt, Dm, 1, gen=gen).to(DEVICE),
        dt_bias=randn(Dm, 1, gen=gen).to(DEVICE),
    )
    compare(pool.view(4, Dm, 1, N), args, [3, -1, 1])
