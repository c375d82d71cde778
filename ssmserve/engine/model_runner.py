"""ModelRunner: StepPlan -> one flat variable-length ForwardBatch -> hidden states, logits."""

from __future__ import annotations

import torch

from ssmserve.layers.batch import ForwardBatch
from ssmserve.models.base import CausalLM
from ssmserve.scheduler.plan import ScheduledChunk


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, block_size: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        from ssmserve.engine.cuda_graphs import DecodeGraphs

        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.device, max_batch, max_blocks)
        self.graphs.capture()

    @staticmethod
    def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """Decodes (one new token, state to resume from) first, then everything else."""
        return [c for c in chunks if c.is_decode] + [c for c in chunks if not c.is_decode]

    def prepare(self, chunks: list[ScheduledChunk], logits_rows: list[int]) -> ForwardBatch:
        """`chunks` must already be in `order_chunks` order."""
        bs = self.block_size
        input_ids, positions, slot_mapping, qsl = [], [], [], [0]
        seq_lens, state_slots, has_init, tables = [], [], [], []
        num_decodes = 0
        for chunk in chunks:
            req = chunk.request
            num_decodes += chunk.is_decode
            pos = range(chunk.start, chunk.end)
            input_ids.extend(req.all_token_ids[chunk.start : chunk.end])
            positions.extend(pos)
            if req.block_ids:
                slot_mapping.extend(req.block_ids[p // bs] * bs + p % bs for p in pos)
            else:
                slot_mapping.extend(-1 for _ in pos)
            qsl.append(qsl[-1] + chunk.num_new_tokens)
            seq_lens.append(chunk.end)
            state_slots.append(req.state_slot if req.state_slot is not None else -1)
            has_init.append(chunk.start > 0)
            tables.append(req.block_ids)
        width = max((len(t) for t in tables), default=0) or 1
        flat_tables = [b for t in tables for b in t + [0] * (width - len(t))]
        # One host-to-device copy for every index array of the step, sliced on the device:
        # a dozen small copies would cost more than the decode step's kernels.
        prefill_starts = [chunk.start for chunk in chunks[num_decodes:]]
        parts = [
            input_ids,
            positions,
            slot_mapping,
            qsl,
            seq_lens,
            state_slots,
            [int(h) for h in has_init],
            logits_rows,
            flat_tables,
            prefill_starts,
        ]
        packed = torch.tensor([v for part in parts for v in part], dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        views = packed.split([len(part) for part in parts])
        (ids_t, pos_t, slots_t, qsl_t, lens_t, state_t, init_t, rows_t, tables_t, starts_t) = views
        qsl_t = qsl_t.to(torch.int32)
        return ForwardBatch(
            input_ids=ids_t,
            positions=pos_t,
            query_start_loc=qsl_t,
            seq_lens=lens_t.to(torch.int32),
            state_slots=state_t,
            has_initial_state=init_t.bool(),
            block_tables=tables_t.to(torch.int32).view(len(tables), width),
            slot_mapping=slots_t,
            logits_indices=rows_t,
            num_decodes=num_decodes,
            query_start_loc_p=qsl_t[num_decodes:] - qsl[num_decodes],
            start_positions_p=starts_t,
            query_start_loc_host=tuple(qsl),
            context_lens_host=tuple(chunk.start for chunk in chunks),
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [K, vocab] (float32) of the rows in batch.logits_indices."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        hidden = self.model(batch)
        if batch.logits_indices.numel() == 0:
            return hidden.new_zeros(0, self.model.lm_head.weight.shape[0], dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()
