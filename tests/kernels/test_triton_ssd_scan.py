"""Triton SSD varlen scan against its PyTorch twin (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCES, assert_close, cu_seqlens_of, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import ssd_scan
from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref, ssd_scan_varlen_triton

pytestmark = requires_triton
SEQ_FIELDS = ("x", "dt", "B", "C", "z")


def make_inputs(
    lengths,
    H,
    P,
    G,
    N,
    num_slots=4,
    dtype=torch.float32,
    state_dtype=torch.float32,
    seed=0,
    with_dz=True,
    packed_xbc=False,
):
    gen = seeded(seed)
    T = sum(lengths)
    inp = dict(
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
    if packed_xbc:
        # As the mixer passes them: strided views into one [T, H*P + 2*G*N] tensor.
        xbc = torch.cat([inp["x"].flatten(1), inp["B"].flatten(1), inp["C"].flatten(1)], 1)
        x, B, C = xbc.split([H * P, G * N, G * N], dim=1)
        inp.update(x=x.view(T, H, P), B=B.view(T, G, N), C=C.view(T, G, N))
    return {k: (v.to(DEVICE) if v is not None else None) for k, v in inp.items()}


def run(fn, inp, lengths, slots, init, **kw):
    return fn(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        cu_seqlens=cu_seqlens_of(lengths).to(DEVICE),
        ssm_state=inp["ssm_state"],
        state_slots=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.tensor(init, device=DEVICE),
        dt_bias=inp["dt_bias"],
        z=inp["z"],
        **kw,
    )


def compare(inp, lengths, slots, init, scale=1.0, fn=ssd_scan_varlen_triton, config=None, **kw):
    """`fn` (the Triton kernel, launch parameters `config`) against the twin."""
    before = inp["ssm_state"].clone()
    pool = before.clone()
    y_ref = run(ssd_scan_varlen_ref, inp, lengths, slots, init, **kw)
    state_ref = inp["ssm_state"].clone()
    inp["ssm_state"] = pool
    extra = {} if config is None else {"config": config}
    y = run(fn, inp, lengths, slots, init, **extra, **kw)
    assert y.dtype == inp["x"].dtype
    assert_close(y, y_ref, scale=scale, msg="y")
    # On the GPU the dots building the state take operands in x's dtype (x scaled by its
    # decay weight is rounded to it), so the coarser of x's and the pool's dtype bounds it.
    coarser = max(inp["x"].dtype, pool.dtype, key=lambda d: TOLERANCES[d][0])
    assert_close(pool, state_ref, dtype=coarser, scale=scale, msg="state pool")
    written = set(slots) | set(kw.get("snapshot_slots", torch.tensor([])).tolist())
    untouched = [i for i in range(pool.shape[0]) if i not in written]
    assert torch.equal(pool[untouched], before[untouched]), "slots of no sequence changed"


# dims deliberately not powers of two; G > 1 in one case
SHAPES = [(3, 5, 1, 6), (4, 16, 2, 16)]
# chunk_size 16 below: shorter than a chunk (7, 1), empty (0), exactly one chunk (16),
# three chunks, the last partial (37); sequences start mid-chunk of the packed batch.
VARLEN = ([7, 37, 0, 1, 16], [2, 0, 5, 1, 4])


@pytest.mark.parametrize("H,P,G,N", SHAPES)
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_matches_twin_float32(H, P, G, N, init, varlen):
    lengths, slots = VARLEN if varlen else ([37], [1])
    inits = [init, not init, init, init, not init] if varlen else [init]
    inp = make_inputs(lengths, H, P, G, N, num_slots=7)
    compare(inp, lengths, slots, inits, chunk_size=16, dt_limit=(0.01, 3.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_twin_16bit(dtype):
    lengths, slots = [19, 40, 5], [3, 0, 1]
    inp = make_inputs(lengths, 4, 8, 2, 8, dtype=dtype, seed=1, packed_xbc=True)
    compare(inp, lengths, slots, [True, False, True], chunk_size=16)


def test_row_and_column_blocks_smaller_than_chunk():
    """Several row blocks per chunk and several column blocks per row block."""
    lengths, slots = [50, 3, 130], [1, 3, 0]
    inp = make_inputs(lengths, 2, 6, 1, 10, seed=4, packed_xbc=True)
    config = {"block": 16, "block_t": 32}
    compare(inp, lengths, slots, [True, False, True], chunk_size=64, config=config)


def test_head_dim_split_into_chains():
    """P split over programs (block_p < P, the last block partial): chains stay separate."""
    lengths, slots = [40, 9, 21], [2, 0, 1]
    inp = make_inputs(lengths, 2, 40, 1, 6, seed=6)
    compare(inp, lengths, slots, [True, False, True], chunk_size=16, config={"block_p": 16})


def test_chunk_id_bound_is_tight():
    """Every sequence ends in a partial chunk: all cdiv(T, chunk) + S - 1 chunk ids are used."""
    lengths, slots = [17, 17, 17], [0, 2, 3]
    inp = make_inputs(lengths, 3, 5, 1, 6, seed=5)
    compare(inp, lengths, slots, [False, True, False], chunk_size=16)


def test_bf16_state_no_gates():
    lengths = [18]
    inp = make_inputs(lengths, 3, 5, 1, 6, state_dtype=torch.bfloat16, seed=2, with_dz=False)
    compare(inp, lengths, [2], [True], chunk_size=16)


@pytest.mark.parametrize("split", [5, 16, 23])
def test_resumed_mid_chunk_equals_whole(split):
    L = 40
    inp = make_inputs([L], 3, 5, 1, 6, seed=3)
    y_whole = run(ssd_scan_varlen_triton, inp, [L], [0], [False], chunk_size=16)
    state_whole = inp["ssm_state"][0].clone()
    first = {k: (v[:split] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    second = {k: (v[split:] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    y1 = run(ssd_scan_varlen_triton, first, [split], [3], [False], chunk_size=16)
    y2 = run(
        ssd_scan_varlen_triton,
        second,
        [L - split],
        [3],
        [True],
        chunk_size=16,
        start_positions=torch.tensor([split], device=DEVICE),
    )
    assert_close(torch.cat([y1, y2]), y_whole)
    assert_close(inp["ssm_state"][3], state_whole)


def test_start_positions_match_twin():
    """Sequences resumed at various absolute positions (mid-chunk, on a boundary, empty)."""
    lengths, slots, positions = [7, 37, 0, 1, 30], [2, 0, 4, 1, 3], [5, 16, 3, 31, 40]
    inp = make_inputs(lengths, 3, 5, 1, 6, num_slots=5, seed=8)
    start = torch.tensor(positions, device=DEVICE)
    compare(
        inp, lengths, slots, [True, False, True, True, False], chunk_size=16, start_positions=start
    )


@pytest.mark.parametrize("block_seq", [ssd_scan._CUMSUM_BLOCK_SEQ, 4])
def test_chunks_align_to_absolute_positions(block_seq, monkeypatch):
    """DESIGN: a resumed prefill's first chunk is shortened so later chunks stay aligned;
    the chunks of each sequence tile it exactly. Also with the metadata kernel walking the
    sequences 4 at a time (more than one block, the last one partial)."""
    monkeypatch.setattr(ssd_scan, "_CUMSUM_BLOCK_SEQ", block_seq)
    lengths, positions = [7, 37, 0, 1, 30, 16], [5, 16, 3, 31, 40, 8]
    chunk = 16
    T, H = sum(lengths), 2
    cu = cu_seqlens_of(lengths).to(DEVICE)
    layout = ssd_scan._chunk_layout(
        torch.zeros(T, H, device=DEVICE),
        -torch.ones(H, device=DEVICE),
        None,
        cu,
        torch.tensor(positions, device=DEVICE),
        chunk,
        True,
        (0.0, float("inf")),
    )
    first = layout["seq_first_chunk"].tolist()
    starts, lens = layout["chunk_start"].tolist(), layout["chunk_len"].tolist()
    owners = layout["chunk_seq"].tolist()
    for s, (length, position) in enumerate(zip(lengths, positions)):
        ids = list(range(first[s], first[s + 1]))
        assert ids and all(owners[i] == s for i in ids)
        seq_start = int(cu[s])
        absolute = [position + starts[i] - seq_start for i in ids]
        assert absolute[0] == position
        assert all(a % chunk == 0 for a in absolute[1:]), absolute
        assert all(0 < lens[i] <= chunk for i in ids) or length == 0
        assert sum(lens[i] for i in ids) == length
        assert all(starts[i] + lens[i] == starts[j] for i, j in zip(ids, ids[1:]))
    assert all(o == -1 for o in owners[first[-1] :]), "ids past the real chunks own nothing"


@pytest.mark.parametrize("block_seq", [ssd_scan._CUMSUM_BLOCK_SEQ, 4])
def test_snapshots_at_chunk_boundaries_match_twin(block_seq, monkeypatch):
    """Prefix caching: states at chunk boundaries (and a sequence's end) go to snapshot
    rows, for sequences resumed mid-chunk and on a boundary. Also with the metadata
    kernel, which maps each chunk to its snapshot row, walking the snapshots 4 at a time
    (two blocks, the last one partial)."""
    monkeypatch.setattr(ssd_scan, "_CUMSUM_BLOCK_SEQ", block_seq)
    lengths, slots, positions = [40, 9, 37], [0, 2, 1], [5, 16, 0]
    # (sequence, tokens): absolute ends 16, 32, 45 (its end); 25 (its end); 16, 32.
    snaps = [(0, 11), (0, 27), (0, 40), (1, 9), (2, 16), (2, 32)]
    seqs, lens = (torch.tensor(c, device=DEVICE) for c in zip(*snaps))
    rows = torch.arange(3, 3 + len(snaps), device=DEVICE)
    inp = make_inputs(lengths, 3, 5, 1, 6, num_slots=3 + len(snaps), seed=9)
    compare(
        inp,
        lengths,
        slots,
        [True, True, False],
        chunk_size=16,
        start_positions=torch.tensor(positions, device=DEVICE),
        snapshot_seqs=seqs,
        snapshot_lens=lens,
        snapshot_slots=rows,
    )


def test_sequences_walked_in_blocks_match_twin(monkeypatch):
    """The metadata kernel walking the sequences 4 at a time (9 sequences: three blocks,
    some sequences empty or resumed) gives the scan of one walk."""
    monkeypatch.setattr(ssd_scan, "_CUMSUM_BLOCK_SEQ", 4)
    lengths, slots = [7, 0, 19, 1, 4, 0, 16, 3, 9], [8, 0, 7, 1, 6, 2, 5, 3, 4]
    positions = torch.tensor([5, 0, 16, 31, 2, 7, 8, 0, 40], device=DEVICE)
    inits = [True, False, True, True, False, True, False, False, True]
    inp = make_inputs(lengths, 2, 5, 1, 6, num_slots=9, seed=10, with_dz=False)
    compare(inp, lengths, slots, inits, chunk_size=16, start_positions=positions)
