"""LLMEngine: add requests, step, abort. The loop every front end (LLM, server) drives."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ssmserve.cache import BlockPool, PrefixCache, StatePool, combine_plans, plan_cache
from ssmserve.config import (
    DEFAULT_MODEL_NAME,
    EngineConfig,
    ModelConfig,
    load_tokenizer,
    read_generation_config,
    resolve_model_path,
    resolve_tokenizer_path,
    resolve_torch_dtype,
    sampling_defaults_from,
)
from ssmserve.distributed.executor import (
    DistributedExecutor,
    LocalExecutor,
    Logits,
    run_worker,
    torchrun_rank,
)
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.engine.collector import freeze_startup_objects, thaw_engine_objects
from ssmserve.engine.model_runner import ModelRunner, order_chunks, step_inputs
from ssmserve.engine.output_processor import Group, OutputProcessor
from ssmserve.engine.sampler import PendingSample, Sampler, SamplerOutput, SamplingRow
from ssmserve.outputs import RequestOutput
from ssmserve.sampling_params import SamplingParams
from ssmserve.scheduler import Request, RequestStatus, ScheduledChunk, Scheduler, StepPlan

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]
DEFAULT_CPU_CACHE_BYTES = 256 * 2**20
# Tokens between state checkpoints inside a prefill for SSM layers without a chunk of
# their own (Mamba1), as the SSD layers' usual chunk.
DEFAULT_CHECKPOINT_INTERVAL = 256


class InvalidRequestError(ValueError):
    """A request the engine cannot take; the message says what to change."""


class RequestFailedError(RuntimeError):
    """Requests failed inside a step. They are gone (blocks and slots freed); every other
    request went on, and the step's other outputs are in `outputs`.

    `failures` maps each failed request id to its exception.
    """

    def __init__(self, failures: dict[str, Exception], outputs: list[RequestOutput]) -> None:
        detail = "; ".join(f"{rid}: {type(e).__name__}: {e}" for rid, e in failures.items())
        super().__init__(f"{len(failures)} request(s) failed: {detail}")
        self.failures = failures
        self.outputs = outputs


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device 'cuda' was asked for but no CUDA GPU is visible; use --device cpu"
        )
    if dev.type == "cuda" and dev.index is None and torchrun_rank() is not None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return dev


def _make_executor(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
):
    """The engine process's executor; under torchrun, ranks other than 0 become workers
    here and exit when rank 0 shuts down."""
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    rank = torchrun_rank()
    if rank is not None:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"torchrun started {world} processes but tensor_parallel_size x "
                f"pipeline_parallel_size is {size}; make them equal to torchrun's "
                "--nproc-per-node x --nnodes"
            )
        if rank != 0:
            run_worker(rank, "env://", config, model_config, device, dtype)
            raise SystemExit(0)
    if size == 1:
        return LocalExecutor(ModelRunner(config, model_config, device, dtype, TensorParallel()))
    return DistributedExecutor(config, model_config, device, dtype)


class LLMEngine:
    """Owns the model, caches, scheduler and sampler. Not thread-safe: drive it from one
    thread (the async server engine runs it in its own thread)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> LLMEngine:
        freeze_startup_objects()  # before the engine exists: it is never frozen itself
        return super().__new__(cls)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_hf(path, config.max_model_len)
        self.model_name = config.model or DEFAULT_MODEL_NAME
        self.sampling_defaults = self._sampling_defaults()
        self.device = _resolve_device(config.device)
        dtype_name = resolve_torch_dtype(
            config.dtype, self.device.type, self.model_config.hf_config
        )
        self.dtype = getattr(torch, dtype_name)
        if (
            self.dtype == torch.bfloat16
            and self.device.type == "cuda"
            and not (torch.cuda.is_bf16_supported())
        ):
            raise RuntimeError("this GPU has no bfloat16 support; pass --dtype float16")
        self.tokenizer = load_tokenizer(
            resolve_tokenizer_path(config.tokenizer, path, config.load_format)
        )
        self.executor = _make_executor(config, self.model_config, self.device, self.dtype)
        try:
            self._setup_caches()
        except BaseException:
            self.executor.shutdown()
            raise
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer)
        self._in_flight: deque[_Step] = deque()  # launched, not yet collected
        self._failures: dict[str, Exception] = {}  # requests that failed in this step
        self._generator = torch.Generator(self.device).manual_seed(config.seed)
        self.prompt_tokens_total = 0

    # -- construction ---------------------------------------------------------------

    def _sampling_defaults(self) -> dict[str, Any]:
        source = self.config.generation_config
        if source == "vllm":
            return {}
        folder = self.model_config.path if source == "auto" else source
        path = os.path.join(folder, "generation_config.json")
        if source != "auto" and not os.path.isfile(path):
            raise ValueError(
                f"generation_config must be auto, vllm or a folder holding a "
                f"generation_config.json; got {source!r}"
            )
        defaults = sampling_defaults_from(read_generation_config(folder))
        try:
            SamplingParams(**defaults)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        if defaults:
            logger.info(
                "sampling defaults from %s: %s (a request that sets a field keeps its own; "
                "--generation-config vllm ignores them)",
                path,
                ", ".join(f"{k}={v}" for k, v in defaults.items()),
            )
        return defaults

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of `generation_config` (vLLM's
        get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    def _setup_caches(self) -> None:
        cfg = self.config
        caching = cfg.enable_prefix_caching
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or (
            8192 if self.device.type == "cuda" else 2048
        )
        if cfg.cache_memory is not None or self.device.type != "cuda":
            budgets = [cfg.cache_memory or DEFAULT_CPU_CACHE_BYTES] * len(self.executor.stages)
        else:
            budgets = self.executor.call("gpu_cache_budget", self.max_num_batched_tokens)
            if min(budgets) <= 0:
                raise RuntimeError(
                    "no GPU memory left for the caches after the weights and activations; "
                    "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
                )
        self.cache_budget_bytes = min(budgets)  # per rank
        # Every rank holds the same block ids and slots for its own layers: plan each
        # pipeline stage (its ranks' largest cache, smallest budget), then take the
        # plan every stage can hold.
        stage_plans = []
        sizes = self.executor.call("cache_bytes")
        for stage in sorted(set(self.executor.stages)):
            ranks = [r for r, s in enumerate(self.executor.stages) if s == stage]
            stage_plans.append(
                plan_cache(
                    budget_bytes=min(budgets[r] for r in ranks),
                    bytes_per_block=max(sizes[r][0] for r in ranks),
                    bytes_per_slot=max(sizes[r][1] for r in ranks),
                    block_size=cfg.block_size,
                    max_num_seqs=cfg.max_num_seqs,
                    max_model_len=self.model_config.max_model_len,
                    num_kv_blocks=cfg.num_kv_blocks,
                    checkpoint_fraction=cfg.prefix_checkpoint_fraction if caching else 0.0,
                    num_checkpoints=cfg.num_prefix_checkpoints if caching else None,
                )
            )
        plan = combine_plans(stage_plans)
        per_block = sum(size[0] for size in sizes)
        per_slot = sum(size[1] for size in sizes)
        self.cache_plan = plan
        self.executor.call("setup", plan, self.max_num_batched_tokens)
        self.block_pool = (
            BlockPool(plan.num_kv_blocks, cfg.block_size, enable_caching=caching)
            if per_block
            else None
        )
        self.state_pool = StatePool(plan.num_state_slots) if per_slot else None
        self.prefix_cache = None
        if caching:
            self.prefix_cache = PrefixCache(
                block_pool=self.block_pool,
                has_state=per_slot > 0,
                num_slots=plan.num_state_slots,
                num_checkpoints=plan.num_state_checkpoints,
                interval=self._checkpoint_interval(),
            )
        self.scheduler = Scheduler(
            max_num_seqs=plan.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_tokens_per_request=plan.max_tokens_per_request,
            block_pool=self.block_pool,
            state_pool=self.state_pool,
            prefix_cache=self.prefix_cache,
        )
        logger.info(
            "cache: %d KV blocks of %d tokens, %d state slots (%s state), %d max seqs, "
            "prefix caching %s (%d state checkpoints)",
            plan.num_kv_blocks,
            cfg.block_size,
            plan.num_state_slots,
            cfg.mamba_ssm_cache_dtype,
            plan.max_num_seqs,
            "on" if caching else "off",
            plan.num_state_checkpoints,
        )

    def _checkpoint_interval(self) -> int:
        """Tokens between state checkpoints inside a prefill: the configured interval,
        checked against what the SSM layers can snapshot, or their chunk."""
        # Ranks of a stage without SSM layers have no constraint (None).
        multiples = {m for m in self.executor.call("state_snapshot_multiple") if m is not None}
        multiple = math.lcm(*multiples) if multiples else None
        interval = self.config.prefix_checkpoint_interval
        if interval is None:
            return multiple or DEFAULT_CHECKPOINT_INTERVAL
        if multiple is not None and interval % multiple:
            raise ValueError(
                f"prefix_checkpoint_interval ({interval}) must be a multiple of {multiple}, the "
                "chunk this model's SSD scan can snapshot at"
            )
        return interval

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and free the caches; the engine is unusable after."""
        self.executor.shutdown()
        thaw_engine_objects()

    # -- requests ---------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                # The distinct types, found at C speed: prompts run to 100k+ ids.
                if not isinstance(ids, (list, tuple)) or not all(
                    issubclass(t, int) and t is not bool for t in set(map(type, ids))
                ):
                    raise InvalidRequestError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        raise InvalidRequestError(
            "a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}; got "
            f"{type(prompt).__name__}"
        )

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Queue a request. Raises InvalidRequestError (and keeps nothing) if it can't run."""
        if request_id in self.outputs.groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        limit = self.scheduler.max_tokens_per_request
        if len(ids) >= limit:
            what = (
                f"max_model_len is {self.model_config.max_model_len}"
                if limit == self.model_config.max_model_len
                else f"the KV cache holds at most {limit} tokens per request"
            )
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but {what}, and at least one token must be "
                "generated; shorten the prompt or raise --max-model-len"
            )
        params = dataclasses.replace(
            params,
            eos_token_ids=() if params.ignore_eos else self.model_config.eos_token_ids,
        )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        group = Group(request_id, text, ids, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for i in range(params.n):
            request = Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                ids,
                max_tokens=max_tokens,
                min_tokens=params.min_tokens,
                eos_token_ids=params.eos_token_ids,
                stop_token_ids=tuple(params.stop_token_ids),
                # Prompt logprobs need every prompt position computed (by sample 0).
                use_prefix_cache=params.prompt_logprobs is None or i > 0,
            )
            group.samples.append(self.outputs.new_sample(i, request, params))
        for sample in group.samples:
            self.scheduler.add_request(sample.request)
        self.outputs.add(group)
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks and slots are free at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.outputs.remove(rid)
            if group is None:
                continue
            for sample in group.samples:
                if sample.finish_reason is None:
                    self.scheduler.abort_request(sample.request.request_id)
                    sample.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups)

    def stats(self) -> dict[str, int]:
        """Cache use and counters. prefix_cache_query_tokens counts the tokens of every
        request admitted with prefix caching on (again after a preemption), and
        prefix_cache_hit_tokens those of them found cached (not computed)."""
        cache = self.prefix_cache
        return {
            "kv_blocks_used": self.block_pool.num_used if self.block_pool else 0,
            "kv_blocks_total": self.block_pool.num_blocks if self.block_pool else 0,
            "state_slots_used": self.state_pool.num_used if self.state_pool else 0,
            "state_slots_total": self.state_pool.num_slots if self.state_pool else 0,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.outputs.generation_tokens_total,
            "kv_blocks_cached": self.block_pool.num_cached if self.block_pool else 0,
            "prefix_cache_checkpoints": cache.num_checkpoints if cache else 0,
            "prefix_cache_state_rows_used": cache.num_rows_used if cache else 0,
            "prefix_cache_state_rows_total": cache.num_rows if cache else 0,
            "prefix_cache_query_tokens": cache.query_tokens if cache else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
        }

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no request is using; True if nothing is left."""
        if self.prefix_cache is None:
            return True
        return self.prefix_cache.clear() == 0

    # -- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance generation by one step; return the outputs of requests that advanced.

        With `overlap_steps` (the default) the engine plans and launches step n+1 while
        the device runs step n, taking n+1's new input tokens from n's sampled ids on
        the device, and reads n's results and builds its outputs while n+1 runs: each
        call returns the outputs of the step before, and the device never waits for the
        host between steps (under tensor parallelism rank 0 broadcasts those ids to the
        other ranks on the device). Under pipeline parallelism, several steps of
        different requests are in flight instead: n+1 is planned while n runs and
        launched once n's tokens are back. Without it, each call runs one step start to
        finish. Every order gives every request the same output.

        Raises RequestFailedError (with the other outputs) when some requests failed in
        their own bookkeeping; the engine stays usable. Any other exception is fatal.
        """
        outputs = self._step()
        if self._failures:
            failures, self._failures = self._failures, {}
            raise RequestFailedError(failures, outputs)
        return outputs

    def _step(self) -> list[RequestOutput]:
        if not self.config.overlap_steps:
            plan = self._plan(allow_pending=True)
            if plan is None:
                return []
            step = self._launch(plan)
            if step is None:
                return []
            self._collect(step)
            return self._finish(step)
        if self.executor.fills_tokens:
            return self._step_ahead()
        depth = self.executor.depth
        plan = self._plan(allow_pending=depth == 1)
        done = None
        if self._in_flight and (depth == 1 or len(self._in_flight) >= depth or plan is None):
            done = self._in_flight.popleft()
            self._collect(done)
        if plan is not None:
            step = self._launch(plan)
            if step is not None:
                self._in_flight.append(step)
        return self._finish(done) if done is not None else []

    def _step_ahead(self) -> list[RequestOutput]:
        """Plan and launch step n+1 while step n runs, then collect n and build its
        outputs (one step in flight between calls)."""
        plan = self._plan(allow_pending=True)
        done = self._in_flight.popleft() if self._in_flight else None
        step = None
        if plan is not None and done is not None and not self._needs_results(plan):
            step = self._launch(plan, ahead_of=done)
            plan = None
        if done is not None:
            self._collect(done)
        if plan is not None:  # nothing in flight, or penalties over n's tokens
            step = self._launch(plan)
        if step is not None:
            self._in_flight.append(step)
        return self._finish(done) if done is not None else []

    def _needs_results(self, plan: StepPlan) -> bool:
        """Whether a chunk of `plan` samples with penalties while some of its request's
        output tokens are still being sampled (the penalties count them on the host)."""
        owner = self.outputs.owner
        for chunk in plan.chunks:
            request = chunk.request
            if chunk.samples and chunk.end > len(request.all_token_ids):
                owned = owner.get(request.request_id)
                if owned is not None and owned[0].params.has_penalties:
                    return True
        return False

    def _plan(self, allow_pending: bool) -> StepPlan | None:
        plan = self.scheduler.schedule(allow_pending)
        if not plan.is_empty:
            return plan
        if self.scheduler.waiting and not self.scheduler.running and not self._in_flight:
            # Admission checks make this unreachable; fail loudly rather than spin.
            raise RuntimeError(
                f"the scheduler cannot start {self.scheduler.waiting[0]} with an empty "
                "engine; this is a bug, please report it"
            )
        return None

    def _launch(self, plan: StepPlan, ahead_of: _Step | None = None) -> _Step | None:
        """Queue the forward and the sampling of a plan's chunks that are still current
        (a request may have finished or been preempted since the plan was made).
        `ahead_of`: the step in flight whose results are not back yet; tokens it is
        sampling come from its sampled ids on the device."""
        dropped = [c for c in plan.chunks if not c.is_current]
        if dropped:
            self.scheduler.discard(plan, dropped)
            plan.chunks = [c for c in plan.chunks if c.is_current]
        if not plan.chunks:
            return None
        self.scheduler.before_launch(plan)
        chunks = order_chunks(plan.chunks)
        step = _Step(plan, time.time())
        rows: list[int] = []
        offset = 0
        for chunk in chunks:
            group, sample = self.outputs.owner[chunk.request.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = step.time
            pl = group.prompt_logprobs
            if pl is not None and sample.index == 0:
                first = max(chunk.start, len(pl) - 1)
                last = min(chunk.end, len(group.prompt_token_ids) - 1)
                if last > first:
                    step.prompt_spans.append((group, first, last - first, len(rows)))
                    rows.extend(offset + p - chunk.start for p in range(first, last))
            if chunk.samples:
                step.row_of[chunk.request.request_id] = len(step.sampling)
                step.sampling.append((chunk, len(rows)))
                rows.append(offset + chunk.num_new_tokens - 1)
            offset += chunk.num_new_tokens
        pending_rows, tokens = None, None
        if ahead_of is not None and ahead_of.pending is not None:
            pending_rows, tokens = ahead_of.row_of, ahead_of.pending.token_ids
        inputs = step_inputs(chunks, rows, self.config.block_size, plan.cache_ops, pending_rows)
        step.logits = self.executor.execute(inputs.pack(), tokens if inputs.fills else None)
        self.scheduler.after_launch(plan)
        if self.executor.depth == 1:
            self._sample(step)  # queued behind the forward; results come back in _collect
        return step

    def _sample(self, step: _Step) -> None:
        logits = step.logits.wait()
        if step.sampling:
            sampling_rows = []
            for chunk, _ in step.sampling:
                group, sample = self.outputs.owner[chunk.request.request_id]
                sampling_rows.append(
                    SamplingRow(
                        group.params,
                        sample.index,
                        group.prompt_token_ids,
                        chunk.request.output_token_ids,
                        chunk.end - chunk.request.num_prompt_tokens,
                    )
                )
            step.pending = self.sampler.launch(
                logits, sampling_rows, self._generator, [r for _, r in step.sampling]
            )
        if step.prompt_spans:
            step.prompt_logprobs = _prompt_logprobs(logits, step.prompt_spans)
        step.logits = None

    def _collect(self, step: _Step) -> None:
        """Wait for a step's tokens and apply them: counters, token and string stops."""
        if step.logits is not None:
            self._sample(step)  # a pipeline's logits arrive from the last stage
        if step.pending is None:  # no chunk samples: the update still settles them
            self.scheduler.update(step.plan, {})
            return
        step.sampled = step.pending.result()
        sampled = {
            chunk.request.request_id: t
            for (chunk, _), t in zip(step.sampling, step.sampled.token_ids, strict=True)
        }
        step.advanced = self.scheduler.update(step.plan, sampled)
        arrived = time.time()  # when the tokens are known (the step was launched earlier)
        for request in step.advanced:
            if request.request_id not in self.outputs.owner:
                continue  # its group failed earlier in this step
            try:
                self.outputs.record([request], step.sampled, step.row_of, self._stop, arrived)
            except Exception as exc:  # noqa: BLE001 - fails that request only
                self._fail(self.outputs.owner[request.request_id][0].request_id, exc)

    def _fail(self, group_id: str, exc: Exception) -> None:
        logger.error("request %s failed: %s: %s", group_id, type(exc).__name__, exc)
        self._failures[group_id] = exc
        self.abort_request(group_id)

    def _stop(self, request: Request, stop: str) -> None:
        if request.is_finished:
            # The length limit ended it with the same token that completed the stop.
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        else:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop)

    def _finish(self, step: _Step) -> list[RequestOutput]:
        """The step's RequestOutputs (built while the next step runs)."""
        owner = self.outputs.owner
        touched = {
            owner[r.request_id][0].request_id: None for r in step.advanced if r.request_id in owner
        }
        if step.prompt_logprobs is not None:
            values, at = step.prompt_logprobs.tolist(), 0
            for group, first, count, _ in step.prompt_spans:
                size = count * (2 + 2 * (group.params.prompt_logprobs or 0))
                if group.request_id in self.outputs.groups:
                    try:
                        self._record_prompt_logprobs(group, first, count, values[at : at + size])
                        touched.setdefault(group.request_id, None)
                    except Exception as exc:  # noqa: BLE001 - fails that request only
                        self._fail(group.request_id, exc)
                at += size
        now, outputs = time.time(), []
        for group_id in touched:
            try:
                outputs += self.outputs.outputs([group_id], now)
            except Exception as exc:  # noqa: BLE001 - fails that request only
                self._fail(group_id, exc)
        return outputs

    def _record_prompt_logprobs(
        self, group: Group, first: int, count: int, values: list[float]
    ) -> None:
        """values: the span's [chosen, rank, top ids..., top logprobs...] rows, flattened."""
        k = group.params.prompt_logprobs or 0
        width = 2 + 2 * k
        for j in range(count):
            row = values[j * width : (j + 1) * width]
            token = group.prompt_token_ids[first + 1 + j]
            top_ids = [int(t) for t in row[2 : 2 + k]]
            group.prompt_logprobs.append(
                self.outputs.logprob_entry(token, row[0], int(row[1]), top_ids, row[2 + k :])
            )


@dataclass
class _Step:
    """A launched step: its plan, where its sampling rows are, and what came back."""

    plan: StepPlan
    time: float
    sampling: list[tuple[ScheduledChunk, int]] = field(default_factory=list)  # chunk, row
    row_of: dict[str, int] = field(default_factory=dict)  # request id -> sampling row
    prompt_spans: list[tuple[Group, int, int, int]] = field(default_factory=list)
    logits: Logits | None = None
    pending: PendingSample | None = None
    prompt_logprobs: torch.Tensor | None = None
    sampled: SamplerOutput | None = None
    advanced: list[Request] = field(default_factory=list)


def _prompt_logprobs(
    logits: torch.Tensor, spans: list[tuple[Group, int, int, int]]
) -> torch.Tensor:
    """Per prompt position of each span: the next prompt token's logprob and rank and the
    top alternatives, flattened into one tensor (read on the host later)."""
    pieces = []
    for group, first, count, row in spans:
        lps = logits[row : row + count].float().log_softmax(-1)
        targets = torch.tensor(
            group.prompt_token_ids[first + 1 : first + 1 + count], device=lps.device
        )
        chosen = lps.gather(1, targets[:, None])
        ranks = (lps > chosen).sum(-1, keepdim=True) + 1
        k = group.params.prompt_logprobs or 0
        parts = [chosen.double(), ranks.double()]
        if k:
            top = lps.topk(k, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        pieces.append(torch.cat(parts, dim=1).flatten())
    return torch.cat(pieces)
