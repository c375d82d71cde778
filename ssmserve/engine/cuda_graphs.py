"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode-only step (every sequence has one new token and a state to resume from) has
the same shapes for a given batch size whatever the requests are, because kernels find
KV blocks through block tables and SSM state through slot indices. So each size is
captured once over one static batch (sliced per size), and a step writes its inputs in
(one launch from the packed step, `decode_inputs`) and replays. Padding rows get state
slot -1 and KV slot -1: kernels skip them and they touch no state. Under tensor
parallelism every rank captures the same sizes and decides with the same
`can_run_packed` / `can_run` (from the step's header), so the collectives inside the
graphs line up.
"""

from __future__ import annotations

import logging

import torch

from ssmserve.kernels import pdl_scope
from ssmserve.kernels.decode_inputs import STATIC, decode_inputs_triton
from ssmserve.layers.batch import ForwardBatch, StepInputs

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_blocks_per_seq: int) -> None:
        self.runner = runner
        self.device = runner.device
        sizes = [s for s in CAPTURE_SIZES if s < max_batch] + [max_batch]
        self.sizes = sorted(set(sizes))
        n = self.sizes[-1]
        self.max_blocks = max(max_blocks_per_seq, 1)
        # NOTE: every static row is padding (state slot -1, KV slot -1), so warm-up and
        # capture runs touch no state.
        inputs = StepInputs(logits_indices=list(range(n)), num_decodes=n)
        for _ in range(n):
            inputs.add_sequence([0], 1, [], runner.block_size, None)
        inputs.block_tables = [[0] * self.max_blocks for _ in range(n)]
        self.static = ForwardBatch.from_packed(inputs.pack(), self.device)
        self.static_inputs = {name: getattr(self.static, name) for name in STATIC}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        # With PDL on, the warm-up runs compile the PDL kernels the capture launches.
        with pdl_scope():
            self._capture()
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            batch = self.static.decode_prefix(size)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.runner.forward_logits(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.runner.forward_logits(batch)
            self._graphs[size] = (graph, logits)

    def can_run_packed(self, head: list[int], has_tokens: bool) -> bool:
        """Whether `run_packed` takes a packed step of header `head` (StepInputs.pack):
        decodes only, one logit each, within the captured sizes and block-table width, no
        cache copies or snapshots (those go through `ForwardBatch`), and the sampled ids
        any fills read."""
        T, S, K, width, nd, saves, restores, copies, snapshots, fills = head
        return (
            bool(self._graphs)
            and 0 < S <= self.sizes[-1]
            and T == S == nd == K
            and width <= self.max_blocks
            and saves + restores + copies + snapshots == 0
            and (fills == 0 or has_tokens)
        )

    @torch.inference_mode()
    def run_packed(
        self, packed: torch.Tensor, head: list[int], tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a packed decode step on the device (header `head`
        from the host; `can_run_packed`): its inputs written into the static buffers in
        one launch (`decode_inputs`), then the replay."""
        n = head[1]
        size = next(s for s in self.sizes if s >= n)
        decode_inputs_triton(packed, head, tokens, self.static_inputs, size)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]

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
