"""CUDA graphs for decode steps: one captured forward per padded batch size.

A decode-only step (every sequence has one new token and a state to resume from) has
the same shapes for a given batch size whatever the requests are, because kernels find
KV blocks through block tables and SSM state through slot indices. So each size is
captured once over static input buffers, and a step copies its inputs in and replays.
Padding rows get state slot -1 and KV slot -1: kernels skip them and they touch no state.
"""

from __future__ import annotations

import logging

import torch

from ssmserve.layers.batch import ForwardBatch
from ssmserve.models.base import CausalLM

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self, model: CausalLM, device: torch.device, max_batch: int, max_blocks_per_seq: int
    ) -> None:
        self.model = model
        self.device = device
        sizes = [s for s in CAPTURE_SIZES if s < max_batch] + [max_batch]
        self.sizes = sorted(set(sizes))
        n = self.sizes[-1]
        self.max_blocks = max(max_blocks_per_seq, 1)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.state_slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            state_slots=self.state_slots[:size],
            has_initial_state=self.has_initial_state[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            logits_indices=self.query_start_loc[:size].long(),
            num_decodes=size,
            query_start_loc_p=self.query_start_loc[:1],
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch)).float()

    @torch.inference_mode()
    def capture(self) -> None:
        # NOTE: every static slot is -1 here, so warm-up and capture runs touch no state.
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            batch = self._batch(size)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

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
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.state_slots[:n].copy_(batch.state_slots)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        if size > n:
            self.state_slots[n:size].fill_(-1)
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]
