"""SSD varlen scan twin against a naive float64 token loop."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testing import assert_close, cu_seqlens_of, naive_ssd, randn, seeded

from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref


def make_inputs(
    lengths,
    H=6,
    P=5,
    G=2,
    N=7,
    num_slots=6,
    dtype=torch.float32,
    state_dtype=torch.float32,
    seed=0,
    with_dz=True,
):
    gen = seeded(seed)
    T = sum(lengths)
    return dict(
        x=randn(T, H, P, gen=gen, dtype=dtype),
        dt=randn(T, H, gen=gen, dtype=dtype, scale=0.5),
        A=-torch.exp(randn(H, gen=gen, scale=0.5)),
        B=randn(T, G, N, gen=gen, dtype=dtype),
        C=randn(T, G, N, gen=gen, dtype=dtype),
        D=randn(H, gen=gen) if with_dz else None,
        z=randn(T, H, P, gen=gen, dtype=dtype) if with_dz else None,
        dt_bias=randn(H, gen=gen, scale=0.5) if with_dz else None,
        ssm_state=randn(num_slots, H, P, N, gen=gen, dtype=state_dtype),
    )


def run(inp, lengths, slots, init, **kw):
    return ssd_scan_varlen_ref(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=cu_seqlens_of(lengths),
        ssm_state=inp["ssm_state"],
        state_slots=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor(init),
        dt_bias=inp["dt_bias"],
        z=inp["z"],
        **kw,
    )


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("with_dz", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [None, [3, 8, 5, 13]])
def test_varlen_matches_naive_loop(G, with_dz, dtype, positions):
    """positions: sequences resumed at those absolute positions (first chunks shortened)."""
    lengths, slots, init = [13, 1, 0, 29], [4, 0, 2, 1], [True, False, True, False]
    inp = make_inputs(lengths, H=6, G=G, dtype=dtype, with_dz=with_dz)
    pool_before = inp["ssm_state"].clone()
    dt_limit = (0.05, 2.0)
    start = None if positions is None else torch.tensor(positions)
    y = run(inp, lengths, slots, init, chunk_size=8, dt_limit=dt_limit, start_positions=start)
    assert y.dtype == dtype and y.shape == inp["x"].shape
    cu = cu_seqlens_of(lengths).tolist()
    for s, slot in enumerate(slots):
        a, b = cu[s], cu[s + 1]
        state0 = pool_before[slot] if init[s] else torch.zeros_like(pool_before[slot])
        y_s, state_s = naive_ssd(
            inp["x"][a:b],
            inp["dt"][a:b],
            inp["A"],
            inp["B"][a:b],
            inp["C"][a:b],
            inp["D"],
            None if inp["z"] is None else inp["z"][a:b],
            inp["dt_bias"],
            True,
            dt_limit,
            state0,
        )
        assert_close(y[a:b], y_s, msg=f"y of sequence {s}")
        assert_close(inp["ssm_state"][slot], state_s, dtype=torch.float32, msg=f"state {s}")
    untouched = [i for i in range(6) if i not in slots]
    assert torch.equal(inp["ssm_state"][untouched], pool_before[untouched])


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_chunk_size_does_not_change_result(chunk_size):
    lengths, slots, init = [21, 17], [0, 3], [True, False]
    inp = make_inputs(lengths, seed=1)
    pool = inp["ssm_state"].clone()
    y_ref = run(inp, lengths, slots, init, chunk_size=256)
    state_ref = inp["ssm_state"].clone()
    inp["ssm_state"] = pool
    y = run(inp, lengths, slots, init, chunk_size=chunk_size)
    assert_close(y, y_ref)
    assert_close(inp["ssm_state"], state_ref)


@pytest.mark.parametrize("split", [1, 5, 8, 13, 30])
def test_resumed_equals_whole(split):
    """A sequence split anywhere (mid-chunk included) equals running it whole."""
    L = 31
    inp = make_inputs([L], seed=2)
    y_whole = run(inp, [L], [2], [False], chunk_size=8)
    state_whole = inp["ssm_state"][2].clone()

    first = {k: (v[:split] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    second = {k: (v[split:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    y1 = run(first, [split], [5], [False], chunk_size=8)
    y2 = run(second, [L - split], [5], [True], chunk_size=8)
    assert_close(torch.cat([y1, y2]), y_whole)
    assert_close(inp["ssm_state"][5], state_whole)


def test_bf16_state_pool_is_cast_back():
    lengths = [9]
    inp = make_inputs(lengths, state_dtype=torch.bfloat16, seed=3)
    before = inp["ssm_state"].clone()
    run(inp, lengths, [1], [True], chunk_size=4)
    y_s, state_s = naive_ssd(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        inp["z"],
        inp["dt_bias"],
        True,
        (0.0, math.inf),
        before[1].float(),
    )
    assert inp["ssm_state"].dtype == torch.bfloat16
    assert_close(inp["ssm_state"][1], state_s)


def test_rejects_bad_shapes():
    inp = make_inputs([5])
    inp["dt"] = inp["dt"][:, :5]
    with pytest.raises(ValueError, match="dt must have shape"):
        run(inp, [5], [0], [False])


def test_snapshots_are_the_states_after_their_prefixes():
    """Prefix caching: snapshot rows hold the state after the first k tokens of their
    sequence (any k for the twin, resumed sequences included); nothing else changes."""
    lengths, slots, init, positions = [13, 29, 1], [4, 1, 0], [True, False, True], [3, 0, 7]
    snaps = [(0, 1, 2), (0, 13, 3), (1, 5, 5), (1, 16, 6), (1, 28, 7), (2, 1, 8)]
    inp = make_inputs(lengths, num_slots=9, seed=4)
    pool_before = inp["ssm_state"].clone()
    kw = dict(chunk_size=8, start_positions=torch.tensor(positions))
    y_plain = run({**inp, "ssm_state": pool_before.clone()}, lengths, slots, init, **kw)
    seqs, lens, rows = (torch.tensor(c) for c in zip(*snaps))
    y = run(inp, lengths, slots, init, snapshot_seqs=seqs, snapshot_lens=lens,
            snapshot_slots=rows, **kw)  # fmt: skip
    assert_close(y, y_plain, msg="snapshots change no output")
    cu = cu_seqlens_of(lengths).tolist()
    for s, k, row in snaps:
        a = cu[s]
        state0 = pool_before[slots[s]] if init[s] else torch.zeros_like(pool_before[0])
        _, state = naive_ssd(
            inp["x"][a : a + k],
            inp["dt"][a : a + k],
            inp["A"],
            inp["B"][a : a + k],
            inp["C"][a : a + k],
            inp["D"],
            inp["z"][a : a + k],
            inp["dt_bias"],
            True,
            (0.0, math.inf),
            state0,
        )
        assert_close(inp["ssm_state"][row], state, msg=f"snapshot of sequence {s} after {k}")


@pytest.mark.parametrize(
    "snaps, message",
    [
        ([(0, 6, 2)], "snapshot_lens must lie in"),
        ([(2, 1, 2)], "snapshot_seqs must lie in"),
        ([(0, 2, 1)], "no sequence of the call uses"),
    ],
)
def test_rejects_bad_snapshots(snaps, message):
    inp = make_inputs([5, 3])
    seqs, lens, rows = (torch.tensor(c) for c in zip(*snaps))
    with pytest.raises(ValueError, match=message):
        run(inp, [5, 3], [0, 1], [False, False], snapshot_seqs=seqs, snapshot_lens=lens,
            snapshot_slots=rows)  # fmt: skip
    with pytest.raises(ValueError, match="go together"):
        run(inp, [5, 3], [0, 1], [False, False], snapshot_seqs=seqs)
