"""Causal conv1d twins (varlen prefill and one-token update) against a naive loop."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, cu_seqlens_of, naive_conv1d, randn, seeded

from ssmserve.kernels.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref


def make_inputs(T, Cd=11, K=4, num_slots=5, dtype=torch.float32, seed=0):
    gen = seeded(seed)
    return dict(
        x=randn(T, Cd, gen=gen, dtype=dtype),
        weight=randn(Cd, K, gen=gen, dtype=dtype),
        bias=randn(Cd, gen=gen, dtype=dtype),
        conv_state=randn(num_slots, Cd, K - 1, gen=gen, dtype=dtype),
    )


def run_varlen(inp, lengths, slots, init, activation="silu", bias=True):
    return causal_conv1d_varlen_ref(
        inp["x"],
        inp["weight"],
        inp["bias"] if bias else None,
        conv_state=inp["conv_state"],
        cu_seqlens=cu_seqlens_of(lengths),
        state_slots=torch.tensor(slots),
        has_initial_state=torch.tensor(init),
        activation=activation,
    )


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_naive_including_short_sequences(K, activation, dtype):
    lengths, slots = [9, 1, 2, 0, 6], [4, 0, 2, 1, 3]
    init = [True, True, False, True, False]
    inp = make_inputs(sum(lengths), K=K, dtype=dtype)
    before = inp["conv_state"].clone()
    y = run_varlen(inp, lengths, slots, init, activation)
    assert y.dtype == dtype
    cu = cu_seqlens_of(lengths).tolist()
    for s, slot in enumerate(slots):
        context = before[slot] if init[s] else torch.zeros_like(before[slot])
        y_s, ctx_s = naive_conv1d(
            inp["x"][cu[s] : cu[s + 1]], inp["weight"], inp["bias"], context, activation
        )
        assert_close(y[cu[s] : cu[s + 1]], y_s, msg=f"sequence {s}")
        assert_close(inp["conv_state"][slot], ctx_s, msg=f"state of sequence {s}")


@pytest.mark.parametrize("split", [1, 2, 5])
def test_resumed_equals_whole(split):
    L = 8
    inp = make_inputs(L)
    y_whole = run_varlen(inp, [L], [0], [False])
    state_whole = inp["conv_state"][0].clone()
    first = dict(inp, x=inp["x"][:split])
    second = dict(inp, x=inp["x"][split:])
    y1 = run_varlen(first, [split], [1], [False])
    y2 = run_varlen(second, [L - split], [1], [True])
    assert_close(torch.cat([y1, y2]), y_whole)
    assert torch.equal(inp["conv_state"][1], state_whole)


@pytest.mark.parametrize("bias", [False, True])
def test_update_matches_varlen_one_token_and_skips_padding(bias):
    inp = make_inputs(4, seed=3)
    slots = [3, -1, 0, 2]
    pool = inp["conv_state"].clone()
    y = causal_conv1d_update_ref(
        inp["x"],
        inp["conv_state"],
        inp["weight"],
        inp["bias"] if bias else None,
        state_slots=torch.tensor(slots),
    )
    for b, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(y[b], torch.zeros_like(y[b]))
            continue
        y_b, ctx_b = naive_conv1d(
            inp["x"][b : b + 1], inp["weight"], inp["bias"] if bias else None, pool[slot], "silu"
        )
        assert_close(y[b], y_b[0])
        assert_close(inp["conv_state"][slot], ctx_b)
    assert torch.equal(inp["conv_state"][[1, 4]], pool[[1, 4]])
