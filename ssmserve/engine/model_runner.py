"""ModelRunner: one rank's model shard, its caches and CUDA graphs; packed step -> logits.

Every rank (the engine process and each tensor-parallel worker) owns one runner and
calls the same methods in the same order, so the collectives inside the model (and
the few inside the methods here) line up across ranks.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from ssmserve.cache import CachePlan
from ssmserve.config import EngineConfig, ModelConfig
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import get_ops
from ssmserve.layers.batch import ForwardBatch, StepInputs
from ssmserve.layers.cache import LayerCache, allocate_caches, apply_cache_copies, cache_bytes
from ssmserve.loader import init_dummy_weights, load_weights
from ssmserve.models.base import ModelContext
from ssmserve.models.registry import model_class
from ssmserve.scheduler.plan import CacheOps, ScheduledChunk

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        tp: TensorParallel,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.block_size = config.block_size
        self.state_dtype = (
            dtype
            if config.mamba_ssm_cache_dtype == "auto"
            else getattr(torch, config.mamba_ssm_cache_dtype)
        )
        self.ops = get_ops(config.kernel_backend, device)
        self.model = self._build_model(model_config)
        self.cache_specs = self.model.cache_specs()
        self.caches: list[LayerCache] = []
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on

    def _build_model(self, model_config: ModelConfig):
        cls = model_class(model_config.architecture)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(model_config.hf_config, ModelContext(self.ops, self.tp))
        finally:
            torch.set_default_dtype(default_dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, model_config.path)
        return model.eval()

    # -- caches ---------------------------------------------------------------------

    def cache_bytes(self) -> tuple[int, int]:
        """Bytes of one KV block and of one state slot, the largest over the ranks."""
        per = torch.tensor(
            cache_bytes(self.cache_specs, self.block_size, self.dtype, self.state_dtype)
        )
        if self.tp.size > 1:
            dist.all_reduce(per, op=dist.ReduceOp.MAX, group=self.tp.cpu_group)
        return int(per[0]), int(per[1])

    def state_snapshot_multiple(self) -> int | None:
        """What every absolute position of a state snapshot inside a prefill chunk must be
        a multiple of (the least common multiple over the SSM layers; None: any)."""
        multiples = [s.state.snapshot_multiple for s in self.cache_specs if s.state]
        multiples = [m for m in multiples if m is not None]
        return math.lcm(*multiples) if multiples else None

    def gpu_cache_budget(self, max_num_batched_tokens: int) -> int:
        """Bytes left for caches on this GPU after the weights and the measured activation
        peak of a full-budget forward; the smallest over the ranks."""
        from ssmserve.engine.memory import profile_activation_peak

        peak = profile_activation_peak(self, max_num_batched_tokens)
        _, total = torch.cuda.mem_get_info(self.device)
        in_use = torch.cuda.memory_allocated(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - in_use - peak
        logger.info(
            "GPU memory (rank %d): %.1f GiB total, %.2f GiB weights, %.2f GiB activation peak, "
            "%.2f GiB for caches",
            self.tp.rank,
            total / 2**30,
            in_use / 2**30,
            peak / 2**30,
            budget / 2**30,
        )
        least = torch.tensor([budget])
        if self.tp.size > 1:
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.tp.cpu_group)
        return int(least[0])

    def allocate_caches(self, num_kv_blocks: int, num_state_slots: int) -> None:
        self.caches = allocate_caches(
            self.cache_specs,
            num_kv_blocks=num_kv_blocks,
            block_size=self.block_size,
            num_state_slots=num_state_slots,
            dtype=self.dtype,
            state_dtype=self.state_dtype,
            device=self.device,
        )

    def release_caches(self) -> None:
        self.caches = []

    def setup(self, plan: CachePlan, max_num_batched_tokens: int) -> None:
        """Allocate the planned caches, then capture decode graphs where they apply."""
        # State rows: the slots, then the prefix-caching checkpoints.
        self.allocate_caches(plan.num_kv_blocks, plan.num_state_slots + plan.num_state_checkpoints)
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if self.ops.backend == "torch":
            logger.info("CUDA graphs need the Triton kernels; running eager")
            return
        from ssmserve.engine.cuda_graphs import DecodeGraphs

        max_blocks = -(-plan.max_tokens_per_request // self.block_size)
        self.graphs = DecodeGraphs(self, plan.max_num_seqs, max_blocks)
        self.graphs.capture()

    # -- the step -------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [K, vocab] (float32) of the rows in batch.logits_indices, eagerly."""
        hidden = self.model(batch, self.caches)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    @torch.inference_mode()
    def execute(self, packed: torch.Tensor) -> torch.Tensor:
        """Logits of one packed step (StepInputs.pack), by graph replay where it can. The
        step's cache copies (prefix caching) come first, outside any graph."""
        batch = ForwardBatch.from_packed(packed, self.device)
        if batch.cache_copies is not None:
            apply_cache_copies(self.caches, batch.cache_copies)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.forward_logits(batch)


def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Decodes (one new token, state to resume from) first, then everything else."""
    return [c for c in chunks if c.is_decode] + [c for c in chunks if not c.is_decode]


def step_inputs(
    chunks: list[ScheduledChunk],
    logits_rows: list[int],
    block_size: int,
    cache_ops: CacheOps | None = None,
) -> StepInputs:
    """The host inputs of one step; `chunks` must be in `order_chunks` order."""
    inputs = StepInputs(logits_indices=logits_rows)
    if cache_ops is not None:
        inputs.state_saves = cache_ops.state_saves
        inputs.state_restores = cache_ops.state_restores
        inputs.block_copies = cache_ops.block_copies
    for chunk in chunks:
        req = chunk.request
        inputs.num_decodes += chunk.is_decode
        inputs.add_sequence(
            req.all_token_ids[chunk.start : chunk.end],
            chunk.start,
            req.block_ids,
            block_size,
            req.state_slot,
        )
        prefill_index = len(inputs.seq_lens) - 1 - inputs.num_decodes
        inputs.snapshots.extend((prefill_index, k, row) for k, row in chunk.snapshots)
    return inputs
