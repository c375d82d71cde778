"""Triton one-token state update against its PyTorch twin (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import state_update
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


def mamba1_args(Bt, Dm, G, N, seed, dtype=torch.float32):
    """Mamba1's layout as the mixer passes it: per-channel dt, A, D, dt_bias (P = 1), x and
    z as row slices of one wider projection output (not contiguous over the batch)."""
    gen = seeded(seed)
    proj = randn(Bt, 3 * Dm, gen=gen, dtype=dtype).to(DEVICE)
    return dict(
        x=proj[:, :Dm].view(Bt, Dm, 1),
        dt=randn(Bt, Dm, 1, gen=gen, dtype=dtype).to(DEVICE),
        A=(-torch.exp(randn(Dm, 1, N, gen=gen))).to(DEVICE),
        B=randn(Bt, G, N, gen=gen, dtype=dtype).to(DEVICE),
        C=randn(Bt, G, N, gen=gen, dtype=dtype).to(DEVICE),
        D=randn(Dm, 1, gen=gen).to(DEVICE),
        z=proj[:, Dm : 2 * Dm].view(Bt, Dm, 1),
        dt_bias=randn(Dm, 1, gen=gen).to(DEVICE),
    )


@pytest.mark.parametrize("Dm,G", [(24, 1), (24, 2), (40, 1)])
def test_mamba1_channels_regrouped_into_heads_match_twin(monkeypatch, Dm, G):
    """Many channels a program (the launch at real sizes): same y and states as the twin,
    including non-contiguous x and z, padding rows, and groups (channels never straddle
    one)."""
    monkeypatch.setattr(state_update, "_MIN_PROGRAMS", 1)
    assert state_update._channels_per_head(3, Dm, G, 5) == (8 if Dm // G % 8 == 0 else 4)
    pool = randn(5, Dm, 1, 5, gen=seeded(2)).to(DEVICE)
    compare(pool, mamba1_args(3, Dm, G, 5, seed=3), [4, -1, 1], dt_limit=(0.01, 2.0))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_mamba1_regrouped_stochastic_rounding_draws_the_twins_bits(monkeypatch, state_dtype):
    """Regrouping keeps each element's flat index, so the noise is the twin's: bit-equal."""
    monkeypatch.setattr(state_update, "_MIN_PROGRAMS", 1)
    Dm, N = 32, 4
    pool = randn(4, Dm, 1, N, gen=seeded(4), scale=0.5).to(state_dtype).to(DEVICE)
    args = mamba1_args(2, Dm, 1, N, seed=5)
    offsets = torch.tensor([11, 12345], device=DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    pool_ref = pool.clone()
    kw = dict(state_slots=slots, rounding_offsets=offsets, rounding_seed=99)
    y_ref = selective_state_update_ref(pool_ref, **args, **kw)
    y = selective_state_update_triton(pool, **args, **kw)
    assert torch.equal(pool, pool_ref)
    assert_close(y, y_ref, msg="y")


def test_mamba1_programs_cover_many_channels_at_real_sizes():
    """Jamba-Mini's 8192 channels at batch 256: 128 a program (2k state elements), not one
    (one program per channel ran 40x off the copy rate on the H200); batch 1 keeps enough
    programs to spread over the SMs."""
    assert state_update._channels_per_head(256, 8192, 1, 16) == 128
    assert state_update._channels_per_head(256, 5120, 1, 16) == 128
    per = state_update._channels_per_head(1, 5120, 1, 16)
    assert 5120 // per >= state_update._MIN_PROGRAMS and per > 1
    assert state_update._channels_per_head(256, 9, 1, 5) == 1


@pytest.mark.parametrize("min_programs", [1, 1 << 20])  # many channels a program, and one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba1_dt_proj_inside_the_update_matches_the_projected_dt(
    monkeypatch, min_programs, dtype
):
    """dt_proj_weight: the low-rank dt (a column slice of x_proj's output, R = 10, not a
    power of two) projected in the kernel gives the twin's result on F.linear's dt, the
    state pool included, padding rows too; the twin's own dt_proj_weight path is that
    same F.linear."""
    monkeypatch.setattr(state_update, "_MIN_PROGRAMS", min_programs)
    Bt, Dm, N, R = 3, 24, 5, 10
    args = mamba1_args(Bt, Dm, 1, N, seed=6, dtype=dtype)
    gen = seeded(7)
    x_dbl = randn(Bt, R + 2 * N, gen=gen, dtype=dtype).to(DEVICE)
    low_rank = x_dbl[:, :R]
    weight = randn(Dm, R, gen=gen, dtype=dtype, scale=0.3).to(DEVICE)
    projected = torch.nn.functional.linear(low_rank, weight).view(Bt, Dm, 1)
    pool = randn(5, Dm, 1, N, gen=seeded(8)).to(DEVICE)
    slots = torch.tensor([4, -1, 1], device=DEVICE)
    pool_ref, pool_twin = pool.clone(), pool.clone()
    y_ref = selective_state_update_ref(pool_ref, **{**args, "dt": projected}, state_slots=slots)
    twin = {**args, "dt": low_rank, "dt_proj_weight": weight}
    y_twin = selective_state_update_ref(pool_twin, **twin, state_slots=slots)
    assert torch.equal(y_twin, y_ref) and torch.equal(pool_twin, pool_ref)
    y = selective_state_update_triton(pool, **twin, state_slots=slots)
    # In bf16 the kernel's sum may round dt to the neighbouring value of F.linear's.
    scale = 1.0 if dtype == torch.float32 else 4.0
    assert_close(y, y_ref, msg="y", scale=scale)
    assert_close(
        pool,
        pool_ref,
        torch.bfloat16 if dtype != torch.float32 else None,
        scale=scale,
        msg="state pool",
    )
    assert torch.equal(y[1], torch.zeros_like(y[1]))


def test_dt_proj_weight_of_the_wrong_shape_is_refused():
    args = mamba1_args(2, 8, 1, 4, seed=9)
    pool = randn(3, 8, 1, 4, gen=seeded(1)).to(DEVICE)
    low_rank = randn(2, 3, gen=seeded(2)).to(DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    for fn in (selective_state_update_ref, selective_state_update_triton):
        with pytest.raises(ValueError, match="dt_proj_weight"):
            fn(
                pool,
                **{**args, "dt": low_rank},
                dt_proj_weight=torch.zeros(8, 4),
                state_slots=slots,
            )
