"""Stochastic rounding of the decode state write: unbiased, deterministic given the seed and
positions, the Triton kernel drawing the twin's bits, and nothing changed with it off."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.state_update import (
    selective_state_update_ref,
    selective_state_update_triton,
)
from ssmserve.kernels.stochastic_rounding import (
    hash32_ref,
    rounding_bits_ref,
    rounding_key,
    stochastic_round_ref,
)

SIXTEEN_BIT = [torch.bfloat16, torch.float16]


def write_values(
    values: torch.Tensor,
    state_dtype: torch.dtype,
    offsets: torch.Tensor | None,
    seed: int = 7,
    op=selective_state_update_ref,
) -> torch.Tensor:
    """Store `values` [R, H, P, N] (float32) through the state update, one row per offset:
    zero state, dt = 1, A = 0, x = 1, B = the value (per n; P = H = 1 here), so the new
    float32 state is exactly `values`. Returns the pool rows written, as float64."""
    R, H, P, N = values.shape
    assert H == P == 1
    pool = torch.zeros(R, H, P, N, dtype=state_dtype, device=DEVICE)
    ones = torch.ones(R, H, P, device=DEVICE)
    op(
        pool,
        ones,
        ones,
        torch.zeros(H, P, N, device=DEVICE),
        values.view(R, 1, N).to(DEVICE),
        torch.zeros(R, 1, N, device=DEVICE),
        dt_softplus=False,
        state_slots=torch.arange(R, device=DEVICE),
        rounding_offsets=offsets,
        rounding_seed=seed,
    )
    return pool.double().cpu()


# Explicit mantissa bits and smallest normal exponent of each 16-bit type.
FORMATS = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}


def spacing(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between the two values of `dtype` around each of `value` (float64)."""
    mantissa, min_exponent = FORMATS[dtype]
    exponent = torch.floor(torch.log2(value.abs())).clamp(min=min_exponent)
    return torch.exp2(exponent - mantissa)


def neighbours(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """The values of `dtype` just toward zero from `value` and one step further out."""
    step = spacing(torch.tensor(value, dtype=torch.float64), dtype).item()
    low = math.trunc(value / step) * step
    return low, low + math.copysign(step, value)


# (value, dtype, chance of rounding away from zero)
CASES = [
    (1 + 2**-8, torch.bfloat16, 0.5),  # half way between 1 and 1 + 2^-7
    (1 + 2**-9, torch.bfloat16, 0.25),
    (-(1 + 3 * 2**-9), torch.bfloat16, 0.75),
    (3 * 2**-130 + 2**-135, torch.bfloat16, 0.25),  # bfloat16 subnormals: spacing 2^-133
    (1 + 2**-11, torch.float16, 0.5),  # float16 spacing at 1 is 2^-10
    (-(1 + 2**-12), torch.float16, 0.25),
    (65000.0, torch.float16, 0.25),  # 64992 + 8, spacing 32
    (2.5 * 2**-24, torch.float16, 0.5),  # float16 subnormals: spacing 2^-24
    (0.25 * 2**-24, torch.float16, 0.25),  # below the smallest subnormal
    (2**-14 - 2**-26, torch.float16, 0.75),  # just under the smallest normal
]


@pytest.mark.parametrize("value,dtype,chance", CASES)
def test_values_between_neighbours_round_away_from_zero_with_their_distance(value, dtype, chance):
    draws = 40_000  # binomial sd of the fraction: <= 0.0025
    low, high = neighbours(value, dtype)
    assert low != high and abs(low) < abs(value) < abs(high)
    assert (abs(value) - abs(low)) / (abs(high) - abs(low)) == pytest.approx(chance)
    values = torch.full((draws, 1, 1, 1), value)
    stored = write_values(values, dtype, torch.arange(draws, device=DEVICE)).flatten()
    assert set(stored.unique().tolist()) <= {low, high}
    up = (stored == high).double().mean().item()
    assert abs(up - chance) < 0.0125, (up, chance)
    # Unbiased: the mean of the stored values is the value, within 5 sd.
    spread = abs(high - low) * math.sqrt(chance * (1 - chance) / draws)
    assert abs(stored.mean().item() - value) < 5 * spread
    # Rounded to nearest, the same writes never land on the far side of the midpoint.
    nearest = write_values(values[:100], dtype, None).flatten()
    assert torch.equal(nearest, torch.full_like(nearest, values[0].item()).to(dtype).double())


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_random_values_are_unbiased(dtype):
    draws = 4000
    value = randn(64, gen=seeded(3)).double()
    values = value.float().view(1, 1, 1, 64).expand(draws, 1, 1, 64).contiguous()
    stored = write_values(values, dtype, torch.arange(draws, device=DEVICE) * 3 + 11)
    # Each value's mean error, in units of its spacing, within 5 sd (<= 0.5 / sqrt(n)).
    error = ((stored.view(draws, 64) - value) / spacing(value, dtype)).mean(0)
    assert error.abs().max() < 5 * 0.5 / math.sqrt(draws)
    nearest = value.to(dtype).double()
    assert (stored.view(draws, 64) != nearest).any(0).all()  # every value rounds both ways


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf * 0 in y
@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("op", ["ref", "triton"])
def test_finite_values_never_round_to_infinity_and_specials_stay(dtype, op):
    if op == "triton":
        pytest.importorskip("triton")
    write = selective_state_update_ref if op == "ref" else selective_state_update_triton
    big = torch.finfo(dtype).max
    finite = [3.4028234663852886e38, -3.4028234663852886e38, big * 1.001, -big * 1.001, big]
    specials = [math.inf, -math.inf, math.nan]
    rows = 200 if op == "ref" else 16
    values = torch.tensor(finite + specials).view(1, 1, 1, -1).expand(rows, 1, 1, -1)
    stored = write_values(values.contiguous(), dtype, torch.arange(rows, device=DEVICE), op=write)
    stored = stored.view(rows, -1)
    assert torch.equal(stored[:, : len(finite)].abs(), torch.full((rows, len(finite)), big))
    assert torch.equal(stored[:, 5:7], torch.tensor([[math.inf, -math.inf]] * rows).double())
    assert stored[:, 7].isnan().all()
    # Signed zeros keep their sign.
    zeros = torch.tensor([0.0, -0.0] * 8)
    rounded = stochastic_round_ref(zeros, dtype, rounding_bits_ref(0, torch.zeros(1), 16)[0])
    assert torch.equal(torch.signbit(rounded), torch.signbit(zeros))


def test_noise_is_a_function_of_seed_offset_and_element_only():
    offsets = torch.tensor([0, 1, 2, 1])
    bits = rounding_bits_ref(5, offsets, 1000)
    assert torch.equal(bits[1], bits[3])  # same offset, same bits: not the row
    assert not torch.equal(bits[0], bits[1])
    assert not torch.equal(bits, rounding_bits_ref(6, offsets, 1000))
    assert bits.min() >= 0 and bits.max() < 2**32
    # Low 16 bits (what bfloat16 rounding adds) cover their range evenly.
    counts = torch.bincount((rounding_bits_ref(1, torch.arange(64), 4096) & 0xFFFF).flatten() >> 12)
    assert counts.float().std() / counts.float().mean() < 0.03
    # Layer keys differ by layer and rank; hash32 is a bijection on a sample.
    keys = {rounding_key(0, layer, rank) for layer in range(64) for rank in range(4)}
    assert len(keys) == 256
    assert hash32_ref(torch.arange(1 << 16)).unique().numel() == 1 << 16


def test_a_row_gets_the_same_rounding_in_any_batch_row_and_slot():
    gen = seeded(4)
    values = randn(3, 1, 1, 32, gen=gen)
    offsets = torch.tensor([40, 41, 42], device=DEVICE)
    stored = write_values(values, torch.bfloat16, offsets)
    order = [2, 0, 1]
    moved = write_values(values[order], torch.bfloat16, offsets[order])
    assert torch.equal(moved, stored[order])


def test_stochastic_round_ref_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        stochastic_round_ref(torch.ones(2), torch.float32, torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------------------- Triton


def exact_args(Bt, H, P, G, N, gen, scale=1.0, tied=True):
    """Arguments whose float32 new state is exact in any order of operations (decay 1,
    dt 1, products and sums of multiples of 1/256 below 2^16), so kernel and twin round
    the same float32 values and must store the same bits."""

    def grid(*shape):
        return torch.randint(-255, 256, shape, generator=gen).float() / 16 * scale

    args = dict(
        x=grid(Bt, H, P),
        dt=torch.ones(Bt, H, P) if not tied else torch.ones(Bt, H)[:, :, None].expand(Bt, H, P),
        A=torch.zeros(H, P, N) if not tied else torch.zeros(H)[:, None, None].expand(H, P, N),
        B=grid(Bt, G, N),
        C=randn(Bt, G, N, gen=gen),
    )
    pool = (grid(8, H, P, N) * scale).to(torch.bfloat16)
    return pool, {k: v.to(DEVICE) for k, v in args.items()}


@requires_triton
@pytest.mark.parametrize("state_dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("tied,scale", [(True, 1.0), (False, 1.0), (True, 2**-12)])
def test_triton_kernel_stores_the_twins_bits(state_dtype, tied, scale):
    gen = seeded(5)
    H, P, G, N = (4, 8, 2, 16) if tied else (9, 1, 1, 5)
    pool, args = exact_args(5, H, P, G, N, gen, scale, tied)
    pool = pool.to(state_dtype).to(DEVICE)
    slots = torch.tensor([6, -1, 0, 3, 2], device=DEVICE)
    offsets = torch.tensor([100, 7, 101, 5000, 2**33 + 3], device=DEVICE)
    pool_ref = pool.clone()
    kw = dict(dt_softplus=False, state_slots=slots, rounding_offsets=offsets, rounding_seed=1)
    selective_state_update_ref(pool_ref, **args, **kw)
    selective_state_update_triton(pool, **args, **kw)
    assert torch.equal(pool.view(torch.int16), pool_ref.view(torch.int16))
    nearest = pool.clone()
    selective_state_update_ref(nearest, **args, dt_softplus=False, state_slots=slots)
    assert not torch.equal(nearest, pool_ref)  # the rounding did something


def mamba2_update_args(Bt, H, P, G, N, gen) -> dict[str, torch.Tensor]:
    """Random x, dt, A, B, C of the Mamba2 layout (dt and A per head, stride 0)."""
    return dict(
        x=randn(Bt, H, P, gen=gen).to(DEVICE),
        dt=randn(Bt, H, gen=gen).to(DEVICE)[:, :, None].expand(Bt, H, P),
        A=(-torch.exp(randn(H, gen=gen))).to(DEVICE)[:, None, None].expand(H, P, N),
        B=randn(Bt, G, N, gen=gen).to(DEVICE),
        C=randn(Bt, G, N, gen=gen).to(DEVICE),
    )


@requires_triton
def test_triton_kernel_draws_the_twins_bits_on_general_inputs():
    """With softplus, exp and D/z, kernel and twin may differ in the last float32 bit of
    the new state; a rounding decision flips only where its noise falls in that bit, so
    all but a few elements store the same bits and none is more than one step apart."""
    gen = seeded(6)
    Bt, H, P, G, N = 6, 4, 16, 2, 16
    pool = randn(8, H, P, N, gen=gen, dtype=torch.bfloat16).to(DEVICE)
    args = mamba2_update_args(Bt, H, P, G, N, gen)
    args.update(
        D=randn(H, gen=gen).to(DEVICE)[:, None].expand(H, P),
        z=randn(Bt, H, P, gen=gen).to(DEVICE),
        dt_bias=randn(H, gen=gen).to(DEVICE)[:, None].expand(H, P),
    )
    kw = dict(
        state_slots=torch.tensor([1, 3, 5, 7, 0, 2], device=DEVICE),
        rounding_offsets=torch.arange(6, device=DEVICE) + 900,
        rounding_seed=12345,
    )
    pool_ref = pool.clone()
    y_ref = selective_state_update_ref(pool_ref, **args, **kw)
    y = selective_state_update_triton(pool, **args, **kw)
    torch.testing.assert_close(y, y_ref, atol=2e-4, rtol=2e-4)
    same = (pool.view(torch.int16) == pool_ref.view(torch.int16)).double().mean().item()
    assert same > 0.99
    steps = (pool.view(torch.int16).int() - pool_ref.view(torch.int16).int()).abs()
    assert steps.max() <= 1


@requires_triton
@pytest.mark.parametrize("op", [selective_state_update_ref, selective_state_update_triton])
def test_without_offsets_a_16_bit_pool_stores_the_float32_result_rounded_to_nearest(op):
    """Off, nothing changes: the 16-bit pool holds the float32 pool's result rounded to
    nearest, and offsets given to a float32 pool change nothing."""
    gen = seeded(8)
    Bt, H, P, G, N = 3, 4, 8, 2, 16
    start = randn(4, H, P, N, gen=gen, dtype=torch.bfloat16)
    args = mamba2_update_args(Bt, H, P, G, N, gen)
    args["state_slots"] = torch.tensor([2, 0, 3], device=DEVICE)
    offsets = torch.tensor([4, 5, 6], device=DEVICE)
    exact = start.float().to(DEVICE)
    y_exact = op(exact, **args)
    with_offsets = start.float().to(DEVICE)
    y_offsets = op(with_offsets, **args, rounding_offsets=offsets, rounding_seed=3)
    assert torch.equal(exact, with_offsets) and torch.equal(y_exact, y_offsets)
    for dtype in SIXTEEN_BIT:
        if op is selective_state_update_triton and dtype == torch.bfloat16 and DEVICE.type == "cpu":
            continue  # Triton's CPU interpreter converts float32 to bfloat16 inexactly
        exact = start.to(dtype).float().to(DEVICE)
        pool = start.to(dtype).to(DEVICE)
        op(exact, **args)
        op(pool, **args)
        assert torch.equal(pool, exact.to(dtype))
