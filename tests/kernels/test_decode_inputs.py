"""decode_inputs: a packed decode step into a CUDA graph's static buffers in one launch,
against what the batch's own tensors give (ForwardBatch.from_packed, the fills applied as
the model runner applies them, one copy per buffer and the padding rows filled)."""

from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.decode_inputs import STATIC, decode_inputs_ref, decode_inputs_triton
from ssmserve.layers.batch import HEADER_LEN, ForwardBatch, StepInputs

MAX_ROWS, MAX_BLOCKS, BLOCK_SIZE = 6, 5, 4


def static_buffers(seed: int) -> dict[str, torch.Tensor]:
    """The buffers of a graph of MAX_ROWS rows, as DecodeGraphs makes them, holding
    values an earlier step left (which rows and columns past this step's must keep)."""
    inputs = StepInputs(logits_indices=list(range(MAX_ROWS)), num_decodes=MAX_ROWS)
    for _ in range(MAX_ROWS):
        inputs.add_sequence([0], 1, [], BLOCK_SIZE, None)
    inputs.block_tables = [[0] * MAX_BLOCKS for _ in range(MAX_ROWS)]
    static = ForwardBatch.from_packed(inputs.pack(), DEVICE)
    gen = torch.Generator().manual_seed(seed)
    buffers = {name: getattr(static, name) for name in STATIC}
    for t in buffers.values():
        t.copy_(torch.randint(0, 1000, t.shape, generator=gen).to(t))
    return buffers


def decode_step(fills: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Three decodes: block tables of 3, 1 and 2 blocks (the packed width 3), one with no
    state slot; `fills` (row, sampled row) take their ids from the step before."""
    inputs = StepInputs(logits_indices=[0, 1, 2], num_decodes=3)
    for i, (tokens, start, blocks) in enumerate(
        [([11], 9, [7, 2, 5]), ([12], 3, [4]), ([13], 6, [8, 1])]
    ):
        inputs.add_sequence(tokens, start, blocks, BLOCK_SIZE, None if i == 1 else 20 + i)
    inputs.fills = fills
    return inputs.pack(), torch.tensor([101, 102, 103, 104], device=DEVICE)


def copies_of_the_batch(packed, tokens, static, size):
    """What DecodeGraphs did from a ForwardBatch before decode_inputs."""
    batch = ForwardBatch.from_packed(packed, DEVICE)
    if batch.fills is not None:
        index, rows = batch.fills
        batch.input_ids.index_copy_(0, index, tokens.index_select(0, rows))
    n = batch.num_seqs
    for name in STATIC[:-1]:
        static[name][:n].copy_(getattr(batch, name))
    static["block_tables"][:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
    if size > n:
        static["state_slots"][n:size].fill_(-1)
        static["slot_mapping"][n:size].fill_(-1)
        static["seq_lens"][n:size].fill_(1)


@requires_triton
@pytest.mark.parametrize("fills", [[], [(0, 3), (2, 0)]])
@pytest.mark.parametrize("size", [3, 5])
def test_decode_inputs_writes_what_the_batch_copies_wrote(fills, size):
    packed, tokens = decode_step(fills)
    head = packed[:HEADER_LEN].tolist()
    want = static_buffers(0)
    # (a clone: on the CPU the batch's ids are a view of it, which the fills write)
    copies_of_the_batch(packed.clone(), tokens, want, size)
    for fn in (decode_inputs_ref, decode_inputs_triton):
        got = static_buffers(0)
        fn(packed.to(DEVICE), head, tokens, got, size)
        for name in STATIC:
            assert torch.equal(got[name], want[name]), (fn.__name__, name)
    # and the step's values are there: a filled row's sampled id, the padding rows
    if fills:
        assert want["input_ids"][0] == 104 and want["input_ids"][2] == 101
    assert want["input_ids"][1] == 12 and want["state_slots"][1] == -1
    assert want["block_tables"][0, :3].tolist() == [7, 2, 5]
    if size == 5:
        assert want["state_slots"][3:5].tolist() == [-1, -1]
        assert want["seq_lens"][3:5].tolist() == [1, 1]


def test_decode_inputs_refuses_what_is_not_a_decode_step():
    inputs = StepInputs(logits_indices=[1], num_decodes=0)
    inputs.add_sequence([5, 6], 0, [3], BLOCK_SIZE, 0)
    packed = inputs.pack()
    with pytest.raises(ValueError, match="1 sequences of 2 tokens"):
        decode_inputs_triton(packed, packed[:HEADER_LEN].tolist(), None, {}, 4)
    packed, _ = decode_step([(0, 1)])
    with pytest.raises(ValueError, match="no sampled ids came"):
        decode_inputs_triton(packed, packed[:HEADER_LEN].tolist(), None, {}, 4)
