"""One-token state update twin: Mamba2 and Mamba1 layouts, padding, consistency."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import assert_close, naive_ssd, randn, seeded

from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref
from ssmserve.kernels.state_update import selective_state_update_ref


def mamba2_inputs(
    Bt, H=6, P=5, G=2, N=7, num_slots=8, dtype=torch.float32, state_dtype=torch.float32, seed=0
):
    gen = seeded(seed)
    return dict(
        x=randn(Bt, H, P, gen=gen, dtype=dtype),
        dt=randn(Bt, H, gen=gen, dtype=dtype, scale=0.5),
        A=-torch.exp(randn(H, gen=gen, scale=0.5)),
        B=randn(Bt, G, N, gen=gen, dtype=dtype),
        C=randn(Bt, G, N, gen=gen, dtype=dtype),
        D=randn(H, gen=gen),
        z=randn(Bt, H, P, gen=gen, dtype=dtype),
        dt_bias=randn(H, gen=gen, scale=0.5),
        ssm_state=randn(num_slots, H, P, N, gen=gen, dtype=state_dtype),
    )


def update_mamba2(inp, slots, dt_limit=(0.0, math.inf)):
    Bt, H, P = inp["x"].shape
    N = inp["B"].shape[2]
    return selective_state_update_ref(
        inp["ssm_state"],
        inp["x"],
        inp["dt"][:, :, None].expand(Bt, H, P),
        inp["A"][:, None, None].expand(H, P, N),
        inp["B"],
        inp["C"],
        inp["D"][:, None].expand(H, P),
        inp["z"],
        dt_bias=inp["dt_bias"][:, None].expand(H, P),
        dt_limit=dt_limit,
        state_slots=torch.tensor(slots),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 2])
def test_mamba2_layout_matches_naive_with_padding(dtype, state_dtype, G):
    slots = [5, -1, 0, 3, -1]
    inp = mamba2_inputs(len(slots), G=G, dtype=dtype, state_dtype=state_dtype)
    before = inp["ssm_state"].clone()
    y = update_mamba2(inp, slots, dt_limit=(0.1, 1.5))
    assert y.dtype == dtype and torch.isfinite(y).all()
    for b, slot in enumerate(slots):
        if slot < 0:
            continue
        y_b, state_b = naive_ssd(
            inp["x"][b : b + 1],
            inp["dt"][b : b + 1],
            inp["A"],
            inp["B"][b : b + 1],
            inp["C"][b : b + 1],
            inp["D"],
            inp["z"][b : b + 1],
            inp["dt_bias"],
            True,
            (0.1, 1.5),
            before[slot].float(),
        )
        assert_close(y[b], y_b[0], msg=f"row {b}")
        assert_close(inp["ssm_state"][slot], state_b, dtype=state_dtype, msg=f"row {b}")
    untouched = [1, 2, 4, 6, 7]
    assert torch.equal(inp["ssm_state"][untouched], before[untouched])


def test_mamba1_layout_matches_naive():
    gen = seeded(1)
    Bt, Dm, N = 3, 9, 4
    u, delta = randn(Bt, Dm, gen=gen), randn(Bt, Dm, gen=gen)
    A = -torch.exp(randn(Dm, N, gen=gen))
    B, C = randn(Bt, N, gen=gen), randn(Bt, N, gen=gen)
    D, z, delta_bias = randn(Dm, gen=gen), randn(Bt, Dm, gen=gen), randn(Dm, gen=gen)
    pool = randn(4, Dm, N, gen=gen)
    before = pool.clone()
    slots = torch.tensor([2, 0, -1])
    y = selective_state_update_ref(
        pool.view(4, Dm, 1, N),
        u[:, :, None],
        delta[:, :, None],
        A[:, None, :],
        B[:, None, :],
        C[:, None, :],
        D[:, None],
        z[:, :, None],
        dt_bias=delta_bias[:, None],
        state_slots=slots,
    )[:, :, 0]
    for b, slot in enumerate([2, 0]):
        dt = torch.nn.functional.softplus(delta[b].double() + delta_bias.double())
        state = (
            torch.exp(dt[:, None] * A.double()) * before[slot].double()
            + (dt * u[b].double())[:, None] * B[b].double()
        )
        y_b = (state @ C[b].double() + D.double() * u[b].double()) * torch.nn.functional.silu(
            z[b].double()
        )
        assert_close(y[b], y_b)
        assert_close(pool[slot], state)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])
    assert torch.equal(y[2], torch.zeros(Dm))


def test_decode_steps_continue_a_prefill():
    """Prefill via the scan, then decode steps via the update == scan over everything."""
    L, steps = 10, 3
    inp = mamba2_inputs(L + steps, seed=2)
    whole_pool = inp["ssm_state"].clone()
    y_whole = ssd_scan_varlen_ref(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=torch.tensor([0, L + steps], dtype=torch.int32),
        ssm_state=whole_pool,
        state_slots=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
        dt_bias=inp["dt_bias"],
        z=inp["z"],
        chunk_size=4,
    )
    pool = inp["ssm_state"]
    ssd_scan_varlen_ref(
        inp["x"][:L],
        inp["dt"][:L],
        inp["A"],
        inp["B"][:L],
        inp["C"][:L],
        inp["D"],
        cu_seqlens=torch.tensor([0, L], dtype=torch.int32),
        ssm_state=pool,
        state_slots=torch.tensor([1]),
        has_initial_state=torch.tensor([False]),
        dt_bias=inp["dt_bias"],
        z=inp["z"][:L],
        chunk_size=4,
    )
    for t in range(L, L + steps):
        step = {k: (v[t : t + 1] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
        y_t = update_mamba2(step, [1])
        assert_close(y_t[0], y_whole[t])
    assert_close(pool[1], whole_pool[1])
