"""A decode step's inputs into a CUDA graph's static buffers, in one launch.

A captured decode graph reads its inputs from fixed buffers (`DecodeGraphs`). Filled from
a `ForwardBatch` they took a launch each: the packed step's int32 conversions, one copy per
buffer, the fills of the sampled ids, the padding rows' fills (about a dozen small
launches a step, queued on the stream between two graphs). `decode_inputs` reads the packed
step on the device once and writes every buffer: per row, the token id (or the sampled id
a fill names), position, KV slot, sequence length, state slot and block-table row; past
the batch, the padding rows' state slot -1, KV slot -1 and length 1.
"""

from __future__ import annotations

import torch

from ssmserve.kernels._common import lazy_jit, tl
from ssmserve.layers.batch import HEADER_LEN

# The static buffers, in the order both forms take them.
STATIC = ("input_ids", "positions", "slot_mapping", "seq_lens", "state_slots", "block_tables")


def packed_offsets(head: list[int]) -> dict[str, int]:
    """Where a packed decode step's parts start (`StepInputs.pack`), from its header."""
    T, S, K = head[:3]
    offsets = {"input_ids": HEADER_LEN, "positions": HEADER_LEN + T}
    offsets["slot_mapping"] = HEADER_LEN + 2 * T
    offsets["seq_lens"] = HEADER_LEN + 3 * T + S + 1  # after query_start_loc
    offsets["state_slots"] = offsets["seq_lens"] + 2 * S  # after the context lengths
    offsets["block_tables"] = offsets["state_slots"] + S + K  # after the logits rows
    return offsets  # the fills are last: their token indices, then their rows


def decode_inputs_ref(
    packed: torch.Tensor,
    head: list[int],
    tokens: torch.Tensor | None,
    static: dict[str, torch.Tensor],
    size: int,
) -> None:
    """Write decode step `packed` (on the device, its header `head` on the host: S
    sequences of one token each, `width` block-table columns) into the `static`
    buffers (STATIC names, each of at least `size` rows), padding rows S..size-1. `tokens`: the step
    before's sampled ids, which the step's fills read."""
    T, S, _, width, *_, n_fill = head
    at = packed_offsets(head)
    for name in STATIC[:-1]:
        part = packed[at[name] : at[name] + S]
        static[name][:S].copy_(part)
    tables = packed[at["block_tables"] : at["block_tables"] + S * width].view(S, width)
    static["block_tables"][:S, :width].copy_(tables)
    if n_fill:
        fills = packed[len(packed) - 2 * n_fill :]
        index, rows = fills[:n_fill], fills[n_fill:]
        static["input_ids"].index_copy_(0, index, tokens.index_select(0, rows))
    if size > S:
        static["state_slots"][S:size].fill_(-1)
        static["slot_mapping"][S:size].fill_(-1)
        static["seq_lens"][S:size].fill_(1)


# Counts and offsets follow the batch: not specialised, so one compile serves every step.
@lazy_jit(
    do_not_specialize=(
        "packed_ptr", "tokens_ptr", "num_seqs", "width", "num_fills", "packed_len",
        "off_pos", "off_slots", "off_lens", "off_state", "off_tables",
    )
)  # fmt: skip
def _decode_inputs_kernel(
    packed_ptr,
    tokens_ptr,
    ids_ptr,
    pos_ptr,
    slots_ptr,
    lens_ptr,
    state_ptr,
    tables_ptr,
    num_seqs,
    width,
    num_fills,
    packed_len,
    off_ids,
    off_pos,
    off_slots,
    off_lens,
    off_state,
    off_tables,
    stride_tables,
    BLOCK_W: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # One program per row of the padded batch.
    row = tl.program_id(0)
    if row < num_seqs:
        token = tl.load(packed_ptr + off_ids + row)
        # A fill names this row's token: the sampled id of its row of the step before.
        filled = row * 0
        source = (row * 0).to(tl.int64)
        fills = packed_ptr + packed_len - 2 * num_fills
        for f0 in range(0, num_fills, BLOCK_F):
            offs = f0 + tl.arange(0, BLOCK_F)
            mask = offs < num_fills
            index = tl.load(fills + offs, mask=mask, other=-1)
            hit = index == row
            filled += tl.sum(hit.to(tl.int32))
            source += tl.sum(
                tl.where(hit, tl.load(fills + num_fills + offs, mask=mask, other=0), 0)
            )
        if filled > 0:
            token = tl.load(tokens_ptr + source)
        tl.store(ids_ptr + row, token.to(ids_ptr.dtype.element_ty))
        tl.store(pos_ptr + row, tl.load(packed_ptr + off_pos + row).to(pos_ptr.dtype.element_ty))
        slot = tl.load(packed_ptr + off_slots + row)
        tl.store(slots_ptr + row, slot.to(slots_ptr.dtype.element_ty))
        seq_len = tl.load(packed_ptr + off_lens + row)
        tl.store(lens_ptr + row, seq_len.to(lens_ptr.dtype.element_ty))
        state = tl.load(packed_ptr + off_state + row)
        tl.store(state_ptr + row, state.to(state_ptr.dtype.element_ty))
        for c0 in range(0, width, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            mask = cols < width
            blocks = tl.load(packed_ptr + off_tables + row * width + cols, mask=mask)
            tl.store(
                tables_ptr + row * stride_tables + cols,
                blocks.to(tables_ptr.dtype.element_ty),
                mask=mask,
            )
    else:  # padding: no state, no KV write, a length of 1
        tl.store(state_ptr + row, -1)
        tl.store(slots_ptr + row, -1)
        tl.store(lens_ptr + row, 1)


def decode_inputs_triton(
    packed: torch.Tensor,
    head: list[int],
    tokens: torch.Tensor | None,
    static: dict[str, torch.Tensor],
    size: int,
) -> None:
    """Triton twin of `decode_inputs_ref` (same arguments and writes), one launch."""
    T, S, _, width, *_, n_fill = head
    if T != S or not 0 < S <= size:
        raise ValueError(f"decode_inputs: {S} sequences of {T} tokens in {size} rows")
    if n_fill and tokens is None:
        raise ValueError("decode_inputs: the step fills input tokens in but no sampled ids came")
    at = packed_offsets(head)
    tables = static["block_tables"]
    _decode_inputs_kernel[(size,)](
        packed,
        tokens if n_fill else packed,
        *(static[name] for name in STATIC),
        S,
        width,
        n_fill,
        packed.shape[0],
        at["input_ids"],
        at["positions"],
        at["slot_mapping"],
        at["seq_lens"],
        at["state_slots"],
        at["block_tables"],
        tables.stride(0),
        BLOCK_W=1024,
        BLOCK_F=256,
        num_warps=1,
    )
