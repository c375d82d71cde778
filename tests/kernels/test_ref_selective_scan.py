"""Mamba1 selective scan twin against a naive float64 token loop."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, cu_seqlens_of, naive_selective_scan, randn, seeded

from ssmserve.kernels.selective_scan import selective_scan_varlen_ref

SEQ_FIELDS = ("u", "delta", "B", "C", "z")


def make_inputs(lengths, Dm=10, N=5, num_slots=5, dtype=torch.float32, seed=0, with_dz=True):
    gen = seeded(seed)
    T = sum(lengths)
    return dict(
        u=randn(T, Dm, gen=gen, dtype=dtype),
        delta=randn(T, Dm, gen=gen, dtype=dtype, scale=0.5),
        A=-torch.exp(randn(Dm, N, gen=gen, scale=0.5)),
        B=randn(T, N, gen=gen, dtype=dtype),
        C=randn(T, N, gen=gen, dtype=dtype),
        D=randn(Dm, gen=gen) if with_dz else None,
        z=randn(T, Dm, gen=gen, dtype=dtype) if with_dz else None,
        delta_bias=randn(Dm, gen=gen, scale=0.5) if with_dz else None,
        ssm_state=randn(num_slots, Dm, N, gen=gen),
    )


def run(inp, lengths, slots, init, **kw):
    return selective_scan_varlen_ref(
        inp["u"],
        inp["delta"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=cu_seqlens_of(lengths),
        ssm_state=inp["ssm_state"],
        state_slots=torch.tensor(slots),
        has_initial_state=torch.tensor(init),
        z=inp["z"],
        delta_bias=inp["delta_bias"],
        **kw,
    )


@pytest.mark.parametrize("with_dz", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softplus", [False, True])
def test_varlen_matches_naive_loop(with_dz, dtype, softplus):
    lengths, slots, init = [11, 0, 1, 19], [3, 1, 0, 4], [True, True, False, False]
    inp = make_inputs(lengths, dtype=dtype, with_dz=with_dz)
    if not softplus:
        inp["delta"] = inp["delta"].abs()
        inp["delta_bias"] = None
    before = inp["ssm_state"].clone()
    y = run(inp, lengths, slots, init, delta_softplus=softplus)
    assert y.dtype == dtype
    cu = cu_seqlens_of(lengths).tolist()
    for s, slot in enumerate(slots):
        a, b = cu[s], cu[s + 1]
        state0 = before[slot] if init[s] else torch.zeros_like(before[slot])
        y_s, state_s = naive_selective_scan(
            inp["u"][a:b],
            inp["delta"][a:b],
            inp["A"],
            inp["B"][a:b],
            inp["C"][a:b],
            inp["D"],
            None if inp["z"] is None else inp["z"][a:b],
            inp["delta_bias"],
            softplus,
            state0,
        )
        assert_close(y[a:b], y_s, msg=f"y of sequence {s}")
        assert_close(inp["ssm_state"][slot], state_s, msg=f"state of sequence {s}")
    assert torch.equal(inp["ssm_state"][2], before[2])


@pytest.mark.parametrize("split", [1, 7, 20])
def test_resumed_equals_whole(split):
    L = 23
    inp = make_inputs([L], seed=1)
    y_whole = run(inp, [L], [0], [False])
    state_whole = inp["ssm_state"][0].clone()
    first = {k: (v[:split] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    second = {k: (v[split:] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    y1 = run(first, [split], [2], [False])
    y2 = run(second, [L - split], [2], [True])
    assert_close(torch.cat([y1, y2]), y_whole)
    assert_close(inp["ssm_state"][2], state_whole)


def test_longer_than_reference_block():
    """Crosses the twin's internal 256-token block boundary."""
    L = 300
    inp = make_inputs([L], Dm=3, N=2, seed=2, with_dz=False)
    y = run(inp, [L], [0], [False])
    y_s, state_s = naive_selective_scan(
        inp["u"],
        inp["delta"],
        inp["A"],
        inp["B"],
        inp["C"],
        None,
        None,
        None,
        True,
        torch.zeros(3, 2),
    )
    assert_close(y, y_s)
    assert_close(inp["ssm_state"][0], state_s)


def test_snapshots_are_the_states_after_their_prefixes():
    """Prefix caching: snapshot rows hold the state after the first k tokens of their
    sequence; outputs do not change."""
    lengths, slots, init = [11, 300, 1], [3, 1, 0], [True, False, False]
    snaps = [(0, 4), (0, 11), (1, 1), (1, 256), (1, 257), (1, 299), (2, 1)]
    inp = make_inputs(lengths, num_slots=5 + len(snaps))
    before = inp["ssm_state"].clone()
    y_plain = run({**inp, "ssm_state": before.clone()}, lengths, slots, init)
    seqs, lens = (torch.tensor(c) for c in zip(*snaps))
    rows = torch.arange(5, 5 + len(snaps))
    y = run(inp, lengths, slots, init, snapshot_seqs=seqs, snapshot_lens=lens,
            snapshot_slots=rows)  # fmt: skip
    assert_close(y, y_plain, msg="snapshots change no output")
    cu = cu_seqlens_of(lengths).tolist()
    for (s, k), row in zip(snaps, rows.tolist(), strict=True):
        a = cu[s]
        state0 = before[slots[s]] if init[s] else torch.zeros_like(before[0])
        _, state = naive_selective_scan(
            inp["u"][a : a + k],
            inp["delta"][a : a + k],
            inp["A"],
            inp["B"][a : a + k],
            inp["C"][a : a + k],
            inp["D"],
            inp["z"][a : a + k],
            inp["delta_bias"],
            True,
            state0,
        )
        assert_close(inp["ssm_state"][row], state, msg=f"snapshot of sequence {s} after {k}")
