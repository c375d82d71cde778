"""Triton Mamba1 selective scan against its PyTorch twin and a naive loop over single
sequences (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, cu_seqlens_of, naive_selective_scan, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import selective_scan
from ssmserve.kernels.selective_scan import (
    selective_scan_varlen_ref,
    selective_scan_varlen_triton,
)

pytestmark = requires_triton
SEQ_FIELDS = ("u", "delta", "B", "C", "z")
# The default token block is 8 here: sequences shorter than a block (1, 6), empty (0),
# one block and a partial one (13), several blocks (20); they start mid-block of the batch.
VARLEN = ([6, 0, 1, 20, 13], [3, 0, 2, 5, 1])


def make_inputs(
    lengths,
    Dm,
    N,
    dtype=torch.float32,
    state_dtype=torch.float32,
    num_slots=6,
    seed=0,
    with_dz=True,
    packed=False,
):
    gen = seeded(seed)
    T = sum(lengths)
    inp = dict(
        u=randn(T, Dm, gen=gen, dtype=dtype),
        delta=randn(T, Dm, gen=gen, dtype=dtype, scale=0.5),
        A=-torch.exp(randn(Dm, N, gen=gen, scale=0.5)),
        B=randn(T, N, gen=gen, dtype=dtype),
        C=randn(T, N, gen=gen, dtype=dtype),
        D=randn(Dm, gen=gen) if with_dz else None,
        z=randn(T, Dm, gen=gen, dtype=dtype) if with_dz else None,
        delta_bias=randn(Dm, gen=gen, scale=0.5) if with_dz else None,
        ssm_state=randn(num_slots, Dm, N, gen=gen, dtype=state_dtype),
    )
    if packed:
        # As the mixer passes them: B and C strided views into x_proj's [T, R + 2N]
        # output, z a view into in_proj's [T, 2 Dm] output.
        dt_rank = 3
        xproj = torch.cat([randn(T, dt_rank, gen=gen, dtype=dtype), inp["B"], inp["C"]], 1)
        _, inp["B"], inp["C"] = xproj.split([dt_rank, N, N], dim=1)
        inp["z"] = torch.cat([inp["u"], inp["z"]], 1)[:, Dm:]
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in inp.items()}


def run(fn, inp, lengths, slots, init, **kw):
    return fn(
        inp["u"],
        inp["delta"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=cu_seqlens_of(lengths).to(DEVICE),
        ssm_state=inp["ssm_state"],
        state_slots=torch.tensor(slots, device=DEVICE),
        has_initial_state=torch.tensor(init, device=DEVICE),
        z=inp["z"],
        delta_bias=inp["delta_bias"],
        **kw,
    )


def compare(inp, lengths, slots, init, config=None, **kw):
    """Triton (launch parameters `config`) against the twin, and each sequence against a
    naive float64 loop."""
    before = inp["ssm_state"].clone()
    pool = before.clone()
    y_ref = run(selective_scan_varlen_ref, inp, lengths, slots, init, **kw)
    state_ref = inp["ssm_state"].clone()
    inp["ssm_state"] = pool
    y = run(selective_scan_varlen_triton, inp, lengths, slots, init, config=config, **kw)
    assert y.dtype == inp["u"].dtype
    assert_close(y, y_ref, msg="y")
    assert_close(pool, state_ref, msg="state pool")
    written = set(slots) | set(kw.get("snapshot_slots", torch.tensor([])).tolist())
    untouched = [i for i in range(pool.shape[0]) if i not in written]
    assert torch.equal(pool[untouched], before[untouched]), "slots of no sequence changed"
    cu = cu_seqlens_of(lengths).tolist()
    cpu = {k: (v.cpu() if v is not None else None) for k, v in inp.items()}
    for s, slot in enumerate(slots):
        a, b = cu[s], cu[s + 1]
        state0 = before[slot].cpu() if init[s] else torch.zeros_like(before[slot].cpu())
        y_s, state_s = naive_selective_scan(
            *(cpu[k][a:b] for k in ("u", "delta")),
            cpu["A"],
            *(cpu[k][a:b] for k in ("B", "C")),
            cpu["D"],
            None if cpu["z"] is None else cpu["z"][a:b],
            cpu["delta_bias"],
            kw.get("delta_softplus", True),
            state0,
        )
        assert_close(y[a:b].cpu(), y_s, dtype=y.dtype, msg=f"y of sequence {s}")
        assert_close(pool[slot].cpu(), state_s, dtype=pool.dtype, msg=f"state of sequence {s}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("with_dz", [False, True])
def test_matches_twin_and_naive_loop(dtype, varlen, with_dz):
    lengths, slots = VARLEN if varlen else ([13], [2])
    init = [True, False, False, True, True] if varlen else [True]
    inp = make_inputs(lengths, 7, 5, dtype=dtype, with_dz=with_dz)  # dims not powers of two
    compare(inp, lengths, slots, init)


def test_channel_blocks_and_full_state_split():
    """Several channel programs, the last one partial; N = 16 as in the real models."""
    lengths, slots = [11, 4], [4, 1]
    inp = make_inputs(lengths, 40, 16, seed=1)
    compare(inp, lengths, slots, [True, False])


def test_packed_views_fp16_bf16_state_no_softplus():
    lengths, slots = [9, 3], [0, 5]
    inp = make_inputs(
        lengths, 6, 4, dtype=torch.float16, state_dtype=torch.bfloat16, seed=2, packed=True
    )
    inp["delta"] = inp["delta"].abs()  # a time step must be positive without softplus
    inp["delta_bias"] = None
    compare(inp, lengths, slots, [True, True], delta_softplus=False)


# Launch parameters the benchmark sweeps: one-token blocks, blocks longer than the sequences,
# all state entries in registers, two lanes per channel, several channel programs.
@pytest.mark.parametrize(
    "override",
    [
        {"block_t": 1},
        {"block_t": 16, "block_d": 8},
        {"n_inner": 1, "block_d": 4},
        {"n_inner": 2, "block_t": 4},
    ],
)
def test_launch_configs(override):
    lengths, slots = [5, 11, 0], [1, 3, 0]
    inp = make_inputs(lengths, 10, 6, seed=3)
    compare(inp, lengths, slots, [True, False, True], config=override)


@pytest.mark.parametrize("split", [3, 8, 13])
def test_resumed_equals_whole(split):
    """Scanning a prefix, then the rest from the slot state, equals one scan of the whole
    (split inside the first block, on a block boundary, inside the second block)."""
    L = 21
    inp = make_inputs([L], 7, 5, seed=4)
    y_whole = run(selective_scan_varlen_triton, inp, [L], [0], [False])
    state_whole = inp["ssm_state"][0].clone()
    first = {k: (v[:split] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    second = {k: (v[split:] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    y1 = run(selective_scan_varlen_triton, first, [split], [3], [False])
    y2 = run(selective_scan_varlen_triton, second, [L - split], [3], [True])
    assert_close(torch.cat([y1, y2]), y_whole)
    assert_close(inp["ssm_state"][3], state_whole)


def test_batch_equals_sequences_alone():
    """A sequence's output and state do not depend on what else is in the batch."""
    lengths, slots, init = VARLEN[0], VARLEN[1], [True, False, True, False, True]
    inp = make_inputs(lengths, 7, 5, dtype=torch.bfloat16, seed=5)
    pool0 = inp["ssm_state"].clone()
    y = run(selective_scan_varlen_triton, inp, lengths, slots, init)
    cu = cu_seqlens_of(lengths).tolist()
    for s, slot in enumerate(slots):
        alone = {k: (v[cu[s] : cu[s + 1]] if k in SEQ_FIELDS else v) for k, v in inp.items()}
        alone["ssm_state"] = pool0.clone()
        y_s = run(selective_scan_varlen_triton, alone, [lengths[s]], [slot], [init[s]])
        assert_close(y_s, y[cu[s] : cu[s + 1]], msg=f"y of sequence {s}")
        assert_close(alone["ssm_state"][slot], inp["ssm_state"][slot], msg=f"state {s}")


@pytest.mark.parametrize("block", [selective_scan._SNAPSHOT_BLOCK, 2])
def test_snapshots_match_twin(block, monkeypatch):
    """Prefix caching: states after any number of tokens go to snapshot rows; several in
    one token block, at a block's end, at a sequence's end (blocks of 8 tokens). Also
    with the kernel counting each sequence's snapshots 2 at a time (four blocks)."""
    monkeypatch.setattr(selective_scan, "_SNAPSHOT_BLOCK", block)
    lengths, slots = VARLEN
    # (sequence, tokens), sorted by sequence, then tokens.
    snaps = [(0, 2), (0, 6), (2, 1), (3, 3), (3, 5), (3, 8), (3, 19), (4, 13)]
    seqs, lens = (torch.tensor(c, device=DEVICE) for c in zip(*snaps))
    rows = torch.arange(6, 6 + len(snaps), device=DEVICE)
    inp = make_inputs(lengths, 7, 5, num_slots=6 + len(snaps), seed=3)
    init = [True, False, False, True, True]
    compare(inp, lengths, slots, init, snapshot_seqs=seqs, snapshot_lens=lens, snapshot_slots=rows)
