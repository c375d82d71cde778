"""ForwardBatch: the flat, variable-length batch one model forward runs on.

Built from `StepInputs` (host lists the model runner fills from a StepPlan) and passed
explicitly to every layer (no global forward context). Sequences are ordered decodes
first: the first `num_decodes` sequences have exactly one new token and an initial
state, so SSM layers can take the one-token update path for them and the varlen prefill
path for the rest.

Every index array of a step travels as one packed int64 tensor (`StepInputs.pack`): one
host-to-device copy per step, and under tensor parallelism the one message rank 0
broadcasts to the other ranks. `ForwardBatch.from_packed` is the one place a batch is
made from it. Prefix caching's per-step work travels in it too: the cache copies made
before the forward (`CacheCopies`) and the chunk-boundary state snapshots the SSM scans
write (`ForwardBatch.snapshots_p`), so every rank does the same to its own shard.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ssmserve.layers.cache import ConvSnapshotSources, conv_snapshot_sources

# Header of a packed step: sizes first, then the flat parts in `pack` order.
HEADER = (
    "num_tokens",
    "num_seqs",
    "num_logits",
    "table_width",
    "num_decodes",
    "num_state_saves",
    "num_state_restores",
    "num_block_copies",
    "num_snapshots",
    "num_fills",
)
HEADER_LEN = len(HEADER)


class CacheCopies(NamedTuple):
    """Row copies made in every layer's caches before a forward, saves first: state
    slot -> checkpoint row, then checkpoint row -> state slot, and KV block -> block."""

    save_slots: torch.Tensor  # [n] int64
    save_rows: torch.Tensor
    restore_rows: torch.Tensor  # [m] int64
    restore_slots: torch.Tensor
    block_sources: torch.Tensor  # [b] int64
    block_destinations: torch.Tensor


@dataclass
class StepInputs:
    """One forward's inputs on the host, per token (T), per sequence (S) and per logit."""

    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    slot_mapping: list[int] = field(default_factory=list)  # [T] KV cache position, -1 skip
    query_start_loc: list[int] = field(default_factory=lambda: [0])  # [S+1]
    seq_lens: list[int] = field(default_factory=list)  # [S] tokens in the cache after
    context_lens: list[int] = field(default_factory=list)  # [S] tokens computed before
    state_slots: list[int] = field(default_factory=list)  # [S] -1 = none
    block_tables: list[list[int]] = field(default_factory=list)  # [S][blocks]
    logits_indices: list[int] = field(default_factory=list)  # [K] rows whose logits count
    num_decodes: int = 0
    # Prefix caching: (slot, row) saves, (row, slot) restores, (source, destination)
    # block copies, and snapshots: prefill sequence index, tokens into its chunk, row.
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # (token index, row): input token `index` is a placeholder for the token sampled in
    # row `row` of the step before, still on the device when this step is launched.
    fills: list[tuple[int, int]] = field(default_factory=list)

    def add_sequence(
        self,
        token_ids: list[int],
        start: int,
        block_ids: list[int],
        block_size: int,
        state_slot: int | None,
    ) -> None:
        """Append one sequence's chunk: `token_ids` at positions start, start+1, ..."""
        end = start + len(token_ids)
        self.input_ids.extend(token_ids)
        if end == start + 1:  # a decode: the common case, kept cheap
            self.positions.append(start)
            self.slot_mapping.append(
                block_ids[start // block_size] * block_size + start % block_size
                if block_ids
                else -1
            )
        else:
            self.positions.extend(range(start, end))
            if block_ids:
                self.slot_mapping.extend(
                    block_ids[p // block_size] * block_size + p % block_size
                    for p in range(start, end)
                )
            else:
                self.slot_mapping.extend([-1] * len(token_ids))
        self.query_start_loc.append(self.query_start_loc[-1] + len(token_ids))
        self.seq_lens.append(end)
        self.context_lens.append(start)
        self.state_slots.append(-1 if state_slot is None else state_slot)
        self.block_tables.append(block_ids)

    def pack(self) -> torch.Tensor:
        """Header + every part, as one int64 CPU tensor."""
        width = max((len(t) for t in self.block_tables), default=0) or 1
        header = [
            len(self.input_ids),
            len(self.seq_lens),
            len(self.logits_indices),
            width,
            self.num_decodes,
            len(self.state_saves),
            len(self.state_restores),
            len(self.block_copies),
            len(self.snapshots),
            len(self.fills),
        ]
        # array('q') takes lists at C speed and hands torch its buffer without a copy:
        # several times cheaper than torch.tensor on a list this long (block tables).
        out = array("q", header)
        for part in (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.query_start_loc,
            self.seq_lens,
            self.context_lens,
            self.state_slots,
            self.logits_indices,
        ):
            out.extend(part)
        padding = [0] * width
        for table in self.block_tables:
            out.extend(table)
            out.extend(padding[: width - len(table)])
        for ops in (self.state_saves, self.state_restores, self.block_copies):
            out.extend(p[0] for p in ops)
            out.extend(p[1] for p in ops)
        for i in (0, 1, 2):
            out.extend(snapshot[i] for snapshot in self.snapshots)
        out.extend(f[0] for f in self.fills)
        out.extend(f[1] for f in self.fills)
        return torch.frombuffer(out, dtype=torch.long)


def sampled_rows_read(packed: torch.Tensor) -> int:
    """How many of the step before's sampled ids a packed step's fills read (the rows
    named are below this); 0 when it has no fills. `packed` on the host."""
    num_fills = int(packed[HEADER_LEN - 1])
    return int(packed[-num_fills:].max()) + 1 if num_fills else 0


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [S+1] int32, token offsets of each sequence
    seq_lens: torch.Tensor  # [S] int32, tokens in the cache after this step
    state_slots: torch.Tensor  # [S] int64, SSM state slot per sequence (-1 = padding)
    has_initial_state: torch.Tensor  # [S] bool, resume from the slot instead of zeros
    block_tables: torch.Tensor  # [S, max_blocks] int32, KV blocks per sequence
    slot_mapping: torch.Tensor  # [T] int64, KV cache position of each token (-1 = skip)
    logits_indices: torch.Tensor  # [K] int64, rows whose logits are wanted
    num_decodes: int  # leading sequences with one token and an initial state
    query_start_loc_p: torch.Tensor  # [S-num_decodes+1] int32, prefill part, rebased to 0
    # [S-num_decodes] absolute position of each prefill sequence's first new token (SSD
    # chunks align to it).
    start_positions_p: torch.Tensor
    # Host copies, for choices made on the host (empty under CUDA graphs): token offsets
    # of each sequence and the tokens each had computed before this step.
    query_start_loc_host: tuple[int, ...] = ()
    context_lens_host: tuple[int, ...] = ()
    # Prefix caching (None when the step has none): copies before the forward, and
    # (prefill sequence index, tokens into its chunk, checkpoint row) of the states the
    # SSM layers write at chunk boundaries, sorted by sequence then tokens.
    cache_copies: CacheCopies | None = None
    snapshots_p: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The snapshots' tokens into their chunk on the host (empty when not known there).
    snapshot_lens_host: tuple[int, ...] = ()
    # Input tokens still to fill in from the step before's sampled ids on the device:
    # (token indices, sampled rows); None when there are none.
    fills: tuple[torch.Tensor, torch.Tensor] | None = None
    # logits_indices is 0..T-1 (a decode graph's batch): the logits rows are the hidden
    # rows as they are, with no gather.
    all_logits: bool = False

    # conv width -> the step's conv snapshot sources, made by the first layer that asks.
    _conv_snapshots: dict[int, ConvSnapshotSources] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def conv_snapshots(self, width: int) -> ConvSnapshotSources:
        """Where this step's conv-state snapshots (`snapshots_p`, which must be set) come
        from for conv states of `width` columns: made once per step and shared by its SSM
        layers, which then make each snapshot with two kernels, not a dozen."""
        sources = self._conv_snapshots.get(width)
        if sources is None:
            nd = self.num_decodes
            lens = self.snapshot_lens_host
            sources = conv_snapshot_sources(
                self.query_start_loc_p,
                self.state_slots[nd:],
                self.has_initial_state[nd:],
                self.snapshots_p,
                width,
                reaches_state=not lens or min(lens) < width,
            )
            self._conv_snapshots[width] = sources
        return sources

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def decode_prefix(self, n: int) -> ForwardBatch:
        """Views of the first `n` sequences of a decode-only batch (one token each), with
        no host copies: what a CUDA graph of batch size n is captured on."""
        assert self.num_decodes == self.num_seqs == self.num_tokens >= n
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            state_slots=self.state_slots[:n],
            has_initial_state=self.has_initial_state[:n],
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
            logits_indices=self.logits_indices[:n],
            num_decodes=n,
            query_start_loc_p=self.query_start_loc_p,
            start_positions_p=self.start_positions_p,
            all_logits=torch.equal(self.logits_indices[:n].cpu(), torch.arange(n)),
        )

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, device: torch.device, host: torch.Tensor | None = None
    ) -> ForwardBatch:
        """The batch of a packed step. `packed` is on the host (copied to `device` here)
        or already on `device`, with `host` its host copy when host values are wanted."""
        host = packed if host is None and packed.device.type == "cpu" else host
        head = (host if host is not None else packed)[:HEADER_LEN].tolist()
        T, S, K, width, nd, n_save, n_restore, n_copy, n_snap, n_fill = head
        data = packed.to(device, non_blocking=True) if packed.device != device else packed
        sizes = [T, T, T, S + 1, S, S, S, K, S * width]
        sizes += [n_save] * 2 + [n_restore] * 2 + [n_copy] * 2 + [n_snap] * 3 + [n_fill] * 2
        parts = data[HEADER_LEN:].split(sizes)
        ids, pos, slots, qsl, lens, ctx, state, rows, tables = parts[:9]
        copies = CacheCopies(*parts[9:15]) if n_save + n_restore + n_copy else None
        qsl = qsl.to(torch.int32)
        qsl_host, ctx_host, snap_lens_host = (), (), ()
        if host is not None:
            offset = HEADER_LEN + 3 * T
            qsl_host = tuple(host[offset : offset + S + 1].tolist())
            offset += S + 1 + S
            ctx_host = tuple(host[offset : offset + S].tolist())
            offset = HEADER_LEN + sum(sizes[:16])  # the snapshots' lens
            snap_lens_host = tuple(host[offset : offset + n_snap].tolist())
        return cls(
            input_ids=ids,
            positions=pos,
            query_start_loc=qsl,
            seq_lens=lens.to(torch.int32),
            state_slots=state,
            has_initial_state=ctx > 0,
            block_tables=tables.to(torch.int32).view(S, width),
            slot_mapping=slots,
            logits_indices=rows,
            num_decodes=nd,
            query_start_loc_p=qsl[nd:] - qsl[nd],
            start_positions_p=ctx[nd:],
            query_start_loc_host=qsl_host,
            context_lens_host=ctx_host,
            cache_copies=copies,
            snapshots_p=tuple(parts[15:18]) if n_snap else None,
            snapshot_lens_host=snap_lens_host,
            fills=tuple(parts[18:20]) if n_fill else None,
        )
