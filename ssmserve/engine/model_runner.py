"""ModelRunner: one rank's model shard, its caches and CUDA graphs; packed step -> logits.

Every rank (the engine process and each tensor-parallel worker) owns one runner and
calls the same methods in the same order, so the collectives inside the model (and
the few inside the methods here) line up across ranks.
"""

from __future__ import annotations

import logging
import math

import torch

from ssmserve.cache import CachePlan
from ssmserve.config import EngineConfig, ModelConfig
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import get_ops
from ssmserve.kernels.stochastic_rounding import rounding_key
from ssmserve.layers.batch import HEADER_LEN, ForwardBatch, StepInputs
from ssmserve.layers.cache import LayerCache, allocate_caches, apply_cache_copies, cache_bytes
from ssmserve.loader import init_dummy_weights, load_weights
from ssmserve.models.base import ModelContext, PipelineStage
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
        stage: PipelineStage | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.stage = stage
        self.block_size = config.block_size
        self.state_dtype = (
            dtype
            if config.mamba_ssm_cache_dtype == "auto"
            else getattr(torch, config.mamba_ssm_cache_dtype)
        )
        self.ops = get_ops(config.kernel_backend, device, pdl=config.decode_pdl)
        self.model = self._build_model(model_config)
        if self.ops.pdl:
            # The linears of one row (batch-1 decode) chain with the other PDL kernels;
            # a gated MLP's gate_up and act(gate) * up are one of them.
            for module in self.model.modules():
                if hasattr(module, "decode_gemv"):
                    module.decode_gemv = self.ops.gemv
                if hasattr(module, "decode_gemv_act_and_mul"):
                    module.decode_gemv_act_and_mul = self.ops.gemv_act_and_mul
        self.cache_specs = self.model.cache_specs()
        self.rounding_seeds = self._rounding_seeds()
        self.caches: list[LayerCache] = []
        self.cache_stacks: list[tuple[str, torch.Tensor]] = []
        self.graphs = None  # DecodeGraphs, when CUDA graphs are on

    def _build_model(self, model_config: ModelConfig):
        cls = model_class(model_config.architecture)
        ctx = ModelContext(self.ops, self.tp, self.stage)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            # A pipeline stage builds the whole model on `meta` (no memory) and then
            # allocates only the modules it runs.
            with torch.device("meta" if self.stage is not None else self.device):
                model = cls(model_config.hf_config, ctx)
        finally:
            torch.set_default_dtype(default_dtype)
        _materialize(model.stage_modules() if self.stage is not None else [model], self.device)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, model_config.path)
        model.fold_constants()
        return model.eval()

    # -- caches ---------------------------------------------------------------------

    def cache_bytes(self) -> tuple[int, int]:
        """Bytes of one KV block and of one state slot of this rank's layers."""
        return cache_bytes(self.cache_specs, self.block_size, self.dtype, self.state_dtype)

    def state_snapshot_multiple(self) -> int | None:
        """What every absolute position of a state snapshot inside a prefill chunk must be
        a multiple of (the least common multiple over the SSM layers; None: any)."""
        multiples = [s.state.snapshot_multiple for s in self.cache_specs if s.state]
        multiples = [m for m in multiples if m is not None]
        return math.lcm(*multiples) if multiples else None

    def gpu_cache_budget(self, max_num_batched_tokens: int) -> int:
        """Bytes left for caches on this GPU after the weights and the measured activation
        peak of a full-budget forward."""
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
        return budget

    def _rounding_seeds(self) -> list[int | None] | None:
        """Each layer position's stochastic rounding key (`SSMState.rounding_seed`), or
        None when decode writes round to nearest (the option is off, or the state is
        float32 and stores exactly)."""
        if not self.config.mamba_ssm_stochastic_rounding:
            return None
        if self.state_dtype == torch.float32:
            logger.warning(
                "mamba_ssm_stochastic_rounding has no effect: the SSM state is float32 "
                "(mamba_ssm_cache_dtype=auto with float32 weights)"
            )
            return None
        return [
            rounding_key(self.config.seed, i, self.tp.rank) for i in range(len(self.cache_specs))
        ]

    def allocate_caches(self, num_kv_blocks: int, num_state_slots: int) -> None:
        self.caches, self.cache_stacks = allocate_caches(
            self.cache_specs,
            num_kv_blocks=num_kv_blocks,
            block_size=self.block_size,
            num_state_slots=num_state_slots,
            dtype=self.dtype,
            state_dtype=self.state_dtype,
            device=self.device,
            rounding_seeds=self.rounding_seeds,
        )

    def release_caches(self) -> None:
        self.caches, self.cache_stacks = [], []

    def setup(self, plan: CachePlan, max_num_batched_tokens: int) -> None:
        """Allocate the planned caches, then capture decode graphs where they apply."""
        # State rows: the slots, then the prefix-caching checkpoints.
        self.allocate_caches(plan.num_kv_blocks, plan.num_state_slots + plan.num_state_checkpoints)
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if self.ops.backend == "torch":
            logger.info("CUDA graphs need the Triton kernels; running eager")
            return
        if self.stage is not None:
            logger.info("pipeline stages run eager (no CUDA graphs)")
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
        rows = hidden if batch.all_logits else hidden[batch.logits_indices]
        return self.model.compute_logits(rows).float()

    @torch.inference_mode()
    def execute(
        self,
        packed: torch.Tensor,
        received: dict[str, torch.Tensor] | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Logits of one packed step (StepInputs.pack), by graph replay where it can; a
        pipeline stage before the last returns what it sends the next stage. The step's
        cache copies (prefix caching) come first, outside any graph. `tokens`: the step
        before's sampled ids on the device, which the step's fills read."""
        if self.device.type == "cuda" and packed.device.type == "cpu":
            # From pinned memory the copy is queued without waiting for the device (a
            # copy from pageable memory may wait for the step in flight to finish).
            packed = packed.pin_memory()
        if self.graphs is not None:
            head = packed[:HEADER_LEN].tolist()
            if self.graphs.can_run_packed(head, tokens is not None):
                data = packed.to(self.device, non_blocking=True)
                return self.graphs.run_packed(data, head, tokens)
        batch = ForwardBatch.from_packed(packed, self.device)
        if batch.fills is not None:
            if tokens is None:
                raise ValueError("this step fills input tokens in but no sampled ids came")
            index, rows = batch.fills
            batch.input_ids.index_copy_(0, index, tokens.index_select(0, rows))
        if batch.cache_copies is not None:
            apply_cache_copies(self.cache_stacks, batch.cache_copies)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        out = self.model(batch, self.caches, received)
        if isinstance(out, dict):
            return out
        return self.model.compute_logits(out[batch.logits_indices]).float()

    def intermediate_buffers(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """Empty tensors to receive the previous stage's output into."""
        spec = self.model.intermediate_spec(num_tokens)
        return {
            k: torch.empty(shape, dtype=dt, device=self.device) for k, (shape, dt) in spec.items()
        }


def _materialize(modules: list[torch.nn.Module], device: torch.device) -> None:
    """Give the parameters these modules hold on `meta` real (uninitialised) storage on
    `device`, keeping their loader attributes; move their buffers (made on the CPU) to
    `device`. A parameter shared by two modules (tied embeddings) stays shared."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                if id(param) not in made:
                    new = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device=device),
                        requires_grad=False,
                    )
                    new.__dict__.update(param.__dict__)
                    made[id(param)] = new
                sub._parameters[name] = made[id(param)]
            for name, buf in list(sub._buffers.items()):
                if buf is not None:
                    if buf.is_meta:
                        raise RuntimeError(
                            f"buffer {name} of {type(sub).__name__} was made on the model's "
                            "device; make computed buffers on the CPU (device='cpu')"
                        )
                    sub._buffers[name] = buf.to(device)


def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Decodes (one new token, state to resume from) first, then everything else."""
    return [c for c in chunks if c.is_decode] + [c for c in chunks if not c.is_decode]


def step_inputs(
    chunks: list[ScheduledChunk],
    logits_rows: list[int],
    block_size: int,
    cache_ops: CacheOps | None = None,
    pending_rows: dict[str, int] | None = None,
) -> StepInputs:
    """The host inputs of one step; `chunks` must be in `order_chunks` order.

    A chunk whose token is still being sampled by the step before (launched, results not
    back) gets a placeholder and a fill from that step's sampled row
    `pending_rows[request id]`.
    """
    inputs = StepInputs(logits_indices=logits_rows)
    if cache_ops is not None:
        inputs.state_saves = cache_ops.state_saves
        inputs.state_restores = cache_ops.state_restores
        inputs.block_copies = cache_ops.block_copies
    for chunk in chunks:
        req = chunk.request
        inputs.num_decodes += chunk.is_decode
        token_ids = req.all_token_ids[chunk.start : chunk.end]
        if len(token_ids) < chunk.num_new_tokens:
            # Only a request's last token can be pending, and a chunk holding it
            # starts there (everything before it is computed).
            assert chunk.num_new_tokens == 1 and pending_rows is not None, chunk
            inputs.fills.append((len(inputs.input_ids), pending_rows[req.request_id]))
            token_ids = [0]
        inputs.add_sequence(
            token_ids,
            chunk.start,
            req.block_ids,
            block_size,
            req.state_slot,
        )
        prefill_index = len(inputs.seq_lens) - 1 - inputs.num_decodes
        inputs.snapshots.extend((prefill_index, k, row) for k, row in chunk.snapshots)
    return inputs
