"""The Gluon (sm_90) SSD scan of kernel_backend "hopper" against the float32 twin and the
Triton-language kernel.

GPU only: the kernel needs an H100/H200 (Gluon does not run in the interpreter). CI on a
CPU skips this file; the Triton-language kernel it stands in for is tested there, and the
backend selection in test_get_ops.py.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_ssd_scan import SEQ_FIELDS, make_inputs, run
from triton_testing import DEVICE

from ssmserve.kernels import get_ops, ssd_scan_hopper
from ssmserve.kernels.ssd_scan import ssd_scan_varlen_ref, ssd_scan_varlen_triton
from ssmserve.kernels.ssd_scan_hopper import ssd_scan_varlen_hopper

pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda"
    or torch.cuda.get_device_capability() != (9, 0)
    or not ssd_scan_hopper.HAS_GLUON,
    reason="the Gluon SSD kernel needs an sm_90 GPU and triton.experimental.gluon",
)

# Sequences shorter than a chunk, empty, exactly one chunk (256), several chunks with a
# partial last one; they start mid-chunk of the packed batch.
LENGTHS = [300, 1, 0, 600, 256, 77]
SLOTS = [5, 0, 2, 1, 4, 3]
INIT = [True, False, True, True, False, True]


def assert_rel_close(actual, expected, tol, msg):
    """Relative L2 error and worst element, both against the reference's scale.

    Element-wise bf16 tolerances do not fit these sizes: each output sums hundreds of
    products of bf16-rounded operands (the bench's checks use the same measure).
    """
    diff = (actual.double() - expected.double()).flatten()
    scale = expected.double().norm() / expected.numel() ** 0.5
    rel = diff.norm() / expected.double().norm()
    worst = diff.abs().max() / scale
    # A wrong row block or tile shows as a worst element of the order of the rms or more.
    assert rel < tol and worst < 100 * tol, f"{msg}: rel. L2 {rel:.2e}, worst {worst:.2e} x rms"


def compare(inp, lengths, slots, init, tol=5e-3):
    """The kernel against the float32 twin; slots of no sequence stay untouched."""
    before = inp["ssm_state"].clone()
    ref = {
        k: (v.float() if k in ("x", "B", "C", "z") and v is not None else v) for k, v in inp.items()
    }
    ref["ssm_state"] = before.clone()
    y_ref = run(ssd_scan_varlen_ref, ref, lengths, slots, init)
    y = run(ssd_scan_varlen_hopper, inp, lengths, slots, init)
    assert y.dtype == inp["x"].dtype
    assert_rel_close(y, y_ref, tol, "y")
    assert_rel_close(inp["ssm_state"][slots], ref["ssm_state"][slots], tol, "state")
    untouched = [i for i in range(before.shape[0]) if i not in slots]
    assert torch.equal(inp["ssm_state"][untouched], before[untouched])


@pytest.fixture
def launches(monkeypatch):
    """Counts the Gluon kernel's launches."""
    calls = []
    launch = ssd_scan_hopper.launch_hopper_scan

    def counting(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(ssd_scan_hopper, "launch_hopper_scan", counting)
    return calls


@pytest.mark.parametrize("G,N", [(1, 128), (2, 64)])
@pytest.mark.parametrize("with_dz", [True, False])
def test_matches_twin(launches, G, N, with_dz):
    inp = make_inputs(
        LENGTHS,
        8,
        64,
        G,
        N,
        num_slots=6,
        dtype=torch.bfloat16,
        seed=11,
        with_dz=with_dz,
        packed_xbc=True,
    )
    compare(inp, LENGTHS, SLOTS, INIT)
    assert launches, "the Gluon kernel was not used"


def test_auto_backend_on_sm90_is_hopper():
    ops = get_ops("auto", DEVICE)
    assert ops.backend == "hopper" and ops.ssd_scan_varlen is ssd_scan_varlen_hopper


def test_repeated_runs_are_identical(launches):
    """The partitions hand shared memory over through mbarriers; a missing fence there lets
    a refill race a read, so runs must agree bit for bit."""
    inp = make_inputs(
        LENGTHS,
        8,
        64,
        1,
        128,
        num_slots=6,
        dtype=torch.bfloat16,
        seed=11,
        with_dz=True,
        packed_xbc=True,
    )
    pool = inp["ssm_state"].clone()
    outs = []
    for _ in range(8):
        inp["ssm_state"] = pool.clone()
        outs.append((run(ssd_scan_varlen_hopper, inp, LENGTHS, SLOTS, INIT), inp["ssm_state"]))
    assert len(launches) == 8
    for y, state in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(state, outs[0][1])


def test_matches_triton_language_kernel(launches):
    lengths = [2000, 333, 1500]
    inp = make_inputs(lengths, 16, 64, 1, 128, num_slots=3, dtype=torch.bfloat16, seed=12)
    pool = inp["ssm_state"].clone()
    y = run(ssd_scan_varlen_hopper, inp, lengths, [2, 0, 1], [True, False, True])
    assert launches
    state = inp["ssm_state"]
    inp["ssm_state"] = pool
    y_tl = run(ssd_scan_varlen_triton, inp, lengths, [2, 0, 1], [True, False, True])
    assert len(launches) == 1, "ssd_scan_varlen_triton must never launch the Gluon kernel"
    # The two kernels round different operands to bf16 (this one: the state entering each
    # 64-token block and the diagonal tile with D on it; the other: C.B^T tiles and the
    # chunk's entering state), each ~2.5e-3 from the float32 twin in rel. L2, so they
    # differ by up to the sum of the two (the states take the same dots: 2e-3).
    assert_rel_close(y, y_tl, 5e-3, "y")
    assert_rel_close(state, inp["ssm_state"], 2e-3, "state")


@pytest.mark.parametrize("split", [100, 256, 517])
def test_resumed_mid_chunk_equals_whole(launches, split):
    L = 900
    inp = make_inputs([L], 4, 64, 1, 128, dtype=torch.bfloat16, seed=13)
    y_whole = run(ssd_scan_varlen_hopper, inp, [L], [0], [False])
    state_whole = inp["ssm_state"][0].clone()
    first = {k: (v[:split] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    second = {k: (v[split:] if k in SEQ_FIELDS else v) for k, v in inp.items()}
    y1 = run(ssd_scan_varlen_hopper, first, [split], [3], [False])
    y2 = run(
        ssd_scan_varlen_hopper,
        second,
        [L - split],
        [3],
        [True],
        start_positions=torch.tensor([split], device=DEVICE),
    )
    assert len(launches) == 3
    assert_rel_close(torch.cat([y1, y2]), y_whole, 2e-3, "y")
    assert_rel_close(inp["ssm_state"][3], state_whole, 2e-3, "state")


@pytest.mark.parametrize("P,dtype", [(32, torch.bfloat16), (64, torch.float16)])
def test_unsupported_calls_use_the_triton_language_kernel(launches, P, dtype):
    lengths = [300]
    inp = make_inputs(lengths, 4, P, 1, 128, num_slots=1, dtype=dtype, seed=14)
    compare(inp, lengths, [0], [True])  # head dim 32 or fp16: not this kernel
    assert not launches


def test_snapshots_at_chunk_boundaries(launches):
    """Prefix caching: the kernel also stores chunk-end states into snapshot rows."""
    lengths, slots, init, positions = [700, 300, 256], [0, 1, 2], [True, False, True], [100, 0, 0]
    # Absolute ends 256, 512, 768 and the end of sequence 0; 256; 256 (the end).
    snaps = [(0, 156), (0, 412), (0, 668), (0, 700), (1, 256), (2, 256)]
    seqs, lens = (torch.tensor(c, device=DEVICE) for c in zip(*snaps))
    rows = torch.arange(3, 3 + len(snaps), device=DEVICE)
    kw = dict(
        start_positions=torch.tensor(positions, device=DEVICE),
        snapshot_seqs=seqs,
        snapshot_lens=lens,
        snapshot_slots=rows,
    )
    inp = make_inputs(lengths, 8, 64, 1, 128, num_slots=9, dtype=torch.bfloat16, seed=15)
    ref = {k: (v.float() if k in ("x", "B", "C", "z") else v) for k, v in inp.items()}
    ref["ssm_state"] = inp["ssm_state"].clone()
    y_ref = run(ssd_scan_varlen_ref, ref, lengths, slots, init, **kw)
    y = run(ssd_scan_varlen_hopper, inp, lengths, slots, init, **kw)
    assert launches, "the Gluon kernel was not used"
    assert_rel_close(y, y_ref, 5e-3, "y")
    for row in rows.tolist():
        assert_rel_close(inp["ssm_state"][row], ref["ssm_state"][row], 5e-3, f"row {row}")
