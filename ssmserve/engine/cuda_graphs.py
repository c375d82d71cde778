"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode-only step (every sequence has one new token and a state to resume from) has
the same shapes for a given batch size whatever the requests are, because kernels find
KV blocks through block tables and SSM state through slot indices. So each size is
captured once over one static batch (sliced per size), and a step copies its inputs in
and replays. Padding rows get state slot -1 and KV slot -1: kernels skip them and they
touch no state. Under tensor parallelism every rank captures the same sizes and decides
with the same `can_run`, so the collectives inside the graphs line up.

With `two_batch_overlap_min_batch`, sizes from that many requests up are captured as two
half-batches on two streams (`HalfBatchOverlap`): one half's MLP (GEMMs, compute-bound at
these sizes) runs beside the other half's SSM mixer or attention (bandwidth-bound), which
kernels in one stream never do.
"""

from __future__ import annotations

import logging
import threading

import torch

from ssmserve.layers.batch import ForwardBatch, StepInputs

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self,
        runner,
        max_batch: int,
        max_blocks_per_seq: int,
        overlap_min_batch: int | None = None,
    ) -> None:
        self.runner = runner
        self.device = runner.device
        sizes = [s for s in CAPTURE_SIZES if s < max_batch] + [max_batch]
        self.sizes = sorted(set(sizes))
        # Sizes captured as two overlapped halves (none when overlap is off).
        self.overlapped = {s for s in self.sizes if overlap_min_batch and s >= overlap_min_batch}
        self.overlap = HalfBatchOverlap(runner) if self.overlapped else None
        n = self.sizes[-1]
        self.max_blocks = max(max_blocks_per_seq, 1)
        # NOTE: every static row is padding (state slot -1, KV slot -1), so warm-up and
        # capture runs touch no state.
        inputs = StepInputs(logits_indices=list(range(n)), num_decodes=n)
        for _ in range(n):
            inputs.add_sequence([0], 1, [], runner.block_size, None)
        inputs.block_tables = [[0] * self.max_blocks for _ in range(n)]
        self.static = ForwardBatch.from_packed(inputs.pack(), self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            batch = self.static.decode_prefix(size)
            forward = self.runner.forward_logits
            if size in self.overlapped:
                forward = self.overlap.forward_logits
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # NOTE: an overlapped forward launches half of its kernels from a second host
            # thread onto a stream joined to the capture; "relaxed" lets that thread do
            # what the capturing thread may not (no such call is made inside the forward).
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="relaxed"):
                logits = forward(batch)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s%s",
            self.sizes,
            f" (two-batch overlap from {min(self.overlapped)})" if self.overlapped else "",
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            bool(self._graphs)
            and batch.num_decodes == batch.num_seqs
            and batch.num_seqs <= self.sizes[-1]
            and batch.logits_indices.shape[0] == batch.num_seqs
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only batch (rows in sequence order)."""
        n = batch.num_seqs
        size = next(s for s in self.sizes if s >= n)
        static = self.static
        static.input_ids[:n].copy_(batch.input_ids)
        static.positions[:n].copy_(batch.positions)
        static.seq_lens[:n].copy_(batch.seq_lens)
        static.state_slots[:n].copy_(batch.state_slots)
        static.slot_mapping[:n].copy_(batch.slot_mapping)
        static.block_tables[:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        if size > n:
            static.state_slots[n:size].fill_(-1)
            static.slot_mapping[n:size].fill_(-1)
            static.seq_lens[n:size].fill_(1)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]


class HalfBatchOverlap:
    """A decode-only batch's logits computed as two halves that take turns at branch ends
    (`ForwardBatch.branch_end`: the end of a mixer, of an MLP), each half on its own
    stream, so that one half's branch k runs beside the other half's branch k + 1:

        stream A:  a1  a2  a3  a4  ...
        stream B:      b1  b2  b3  ...

    Half B's branch k waits for A's branch k to end, and A's branch k + 2 for B's branch k,
    so the pairs that run together are always one mixer and one MLP. The halves share no
    rows (state slots, KV blocks and logits rows are their own), so the only ordering
    between them is this one. The host walks both forwards in the same interleaved order,
    B's in a second thread that holds the turn only between A's branch ends: recording an
    event always comes before waiting on it. Without CUDA (tests) the same turns run with
    no streams, which checks that the halves give the batch's results.
    """

    def __init__(self, runner) -> None:
        self.runner = runner
        self.cuda = runner.device.type == "cuda"
        self.side = torch.cuda.Stream(runner.device) if self.cuda else None

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab] (float32) of a decode-only batch of at least two rows."""
        n = batch.num_seqs
        half = n // 2
        halves = [batch.decode_rows(0, half), batch.decode_rows(half, n)]
        model = self.runner.model
        turns = _Turns(self.cuda)
        for me, h in enumerate(halves):
            h.at_branch_end = lambda me=me: turns.branch_end(me)
        out: list[torch.Tensor | None] = [None, None]

        def run(me: int) -> None:
            try:
                h = halves[me]
                hidden = model(h, self.runner.caches)
                out[me] = model.compute_logits(hidden[h.logits_indices]).float()
            finally:
                turns.finish(me)

        main = torch.cuda.current_stream(self.runner.device) if self.cuda else None
        if self.cuda:
            self.side.wait_stream(main)
        turns.streams = (main, self.side)
        second = threading.Thread(target=self._second_half, args=(run, turns), daemon=True)
        second.start()
        try:
            run(0)
        finally:
            second.join()
        if turns.error is not None:
            raise turns.error
        if self.cuda:
            main.wait_stream(self.side)
            if not torch.cuda.is_current_stream_capturing():
                out[1].record_stream(main)  # made on the side stream, read by the cat
        return torch.cat(out, dim=0)

    @torch.inference_mode()
    def _second_half(self, run, turns: _Turns) -> None:
        try:
            turns.wait_first_turn()
            if self.cuda:
                with torch.cuda.device(self.runner.device), torch.cuda.stream(self.side):
                    run(1)
            else:
                run(1)
        except BaseException as e:  # noqa: BLE001 (re-raised by the first half's thread)
            turns.error = e


class _Turns:
    """The host order of an overlapped forward's two halves (threads) and the stream
    events that give the device the same order (see `HalfBatchOverlap`)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.cond = threading.Condition()
        self.turn = 0  # the half whose thread may launch work
        self.done = [False, False]
        self.ends: tuple[list, list] = ([], [])  # per half, an event at each branch end
        self.streams: tuple = (None, None)
        self.error: BaseException | None = None

    def _record(self, me: int) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.streams[me])
        return event

    def _wait_for(self, me: int, other_branch: int) -> None:
        """Half `me`'s stream waits for the other half's branch `other_branch` (1-based)."""
        ends = self.ends[1 - me]
        if self.cuda and 1 <= other_branch <= len(ends):
            self.streams[me].wait_event(ends[other_branch - 1])

    def _hand_over(self, me: int) -> None:
        with self.cond:
            self.turn = 1 - me
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me or self.done[1 - me])

    def wait_first_turn(self) -> None:
        """Half B waits until A has run its first two branches, then starts after A's
        first branch."""
        with self.cond:
            self.cond.wait_for(lambda: self.turn == 1 or self.done[0])
        self._wait_for(1, 1)

    def branch_end(self, me: int) -> None:
        self.ends[me].append(self._record(me))
        k = len(self.ends[me])
        if me == 0 and k == 1:
            return  # A runs two branches before B's first
        self._hand_over(me)
        # Next is this half's branch k + 1: B's waits for A's k + 1, A's for B's k - 1.
        self._wait_for(me, k + 1 if me == 1 else k - 1)

    def finish(self, me: int) -> None:
        with self.cond:
            self.done[me] = True
            self.turn = 1 - me
            self.cond.notify_all()
