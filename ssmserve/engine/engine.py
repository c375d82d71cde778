"""LLMEngine: add requests, step, abort. The loop every front end (LLM, server) drives."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ssmserve.cache import BlockPool, PrefixCache, StatePool, plan_cache
from ssmserve.config import (
    DEFAULT_MODEL_NAME,
    EngineConfig,
    ModelConfig,
    resolve_model_path,
    resolve_tokenizer_path,
    resolve_torch_dtype,
)
from ssmserve.distributed.executor import (
    LocalExecutor,
    TensorParallelExecutor,
    run_worker,
    torchrun_rank,
)
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from ssmserve.engine.model_runner import ModelRunner, order_chunks, step_inputs
from ssmserve.engine.sampler import Sampler, SamplerOutput, SamplingRow
from ssmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ssmserve.sampling_params import SamplingParams
from ssmserve.scheduler import Request, RequestStatus, ScheduledChunk, Scheduler

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]
DEFAULT_CPU_CACHE_BYTES = 256 * 2**20
# Tokens between state checkpoints inside a prefill for SSM layers without a chunk of
# their own (Mamba1), as the SSD layers' usual chunk.
DEFAULT_CHECKPOINT_INTERVAL = 256


class InvalidRequestError(ValueError):
    """A request the engine cannot take; the message says what to change."""


@dataclass
class _Sample:
    """One of a request's n samples: a scheduler Request plus its output-side state."""

    index: int
    request: Request
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    text_end: int | None = None  # where a stop string cut the text


@dataclass
class _Group:
    """A user request: prompt, params, and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


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
    size = config.tensor_parallel_size
    rank = torchrun_rank()
    if rank is not None:
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(
                f"torchrun started {world} processes but tensor_parallel_size is {size}; "
                "pass --tensor-parallel-size equal to torchrun's --nproc-per-node x --nnodes"
            )
        if rank != 0:
            run_worker(rank, size, "env://", config, model_config, device, dtype)
            raise SystemExit(0)
    if size == 1:
        return LocalExecutor(ModelRunner(config, model_config, device, dtype, TensorParallel()))
    return TensorParallelExecutor(config, model_config, device, dtype)


class LLMEngine:
    """Owns the model, caches, scheduler and sampler. Not thread-safe: drive it from one
    thread (the async server engine runs it in its own thread)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_hf(path, config.max_model_len)
        self.model_name = config.model or DEFAULT_MODEL_NAME
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
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(
            resolve_tokenizer_path(config.tokenizer, path, config.load_format)
        )
        self.executor = _make_executor(config, self.model_config, self.device, self.dtype)
        try:
            self._setup_caches()
        except BaseException:
            self.executor.shutdown()
            raise
        self.sampler = Sampler()
        self._groups: dict[str, _Group] = {}
        self._owner: dict[str, tuple[_Group, _Sample]] = {}
        self._generator = torch.Generator(self.device).manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- construction ---------------------------------------------------------------

    def _setup_caches(self) -> None:
        cfg = self.config
        caching = cfg.enable_prefix_caching
        per_block, per_slot = self.executor.call("cache_bytes")
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or (
            8192 if self.device.type == "cuda" else 2048
        )
        if cfg.cache_memory is not None:
            budget = cfg.cache_memory
        elif self.device.type == "cuda":
            budget = self.executor.call("gpu_cache_budget", self.max_num_batched_tokens)
            if budget <= 0:
                raise RuntimeError(
                    "no GPU memory left for the caches after the weights and activations; "
                    "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
                )
        else:
            budget = DEFAULT_CPU_CACHE_BYTES
        plan = plan_cache(
            budget_bytes=budget,
            bytes_per_block=per_block,
            bytes_per_slot=per_slot,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.model_config.max_model_len,
            num_kv_blocks=cfg.num_kv_blocks,
            checkpoint_fraction=cfg.prefix_checkpoint_fraction if caching else 0.0,
            num_checkpoints=cfg.num_prefix_checkpoints if caching else None,
        )
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
        multiple = self.executor.call("state_snapshot_multiple")
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

    # -- requests ---------------------------------------------------------------------

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
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
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
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
        group = _Group(request_id, text, ids, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(params.seed + i)
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
            sample = _Sample(
                index=i,
                request=request,
                generator=generator or self._generator,
                detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
            )
            group.samples.append(sample)
        for sample in group.samples:
            self.scheduler.add_request(sample.request)
            self._owner[sample.request.request_id] = (group, sample)
        self._groups[request_id] = group
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks and slots are free at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for sample in group.samples:
                self._owner.pop(sample.request.request_id, None)
                if sample.finish_reason is None:
                    self.scheduler.abort_request(sample.request.request_id)
                    sample.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

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
            "generation_tokens_total": self.generation_tokens_total,
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
        """Schedule, run the model once, sample, and report requests that advanced."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.waiting and not self.scheduler.running:
                # Admission checks make this unreachable; fail loudly rather than spin.
                raise RuntimeError(
                    f"the scheduler cannot start {self.scheduler.waiting[0]} with an empty "
                    "engine; this is a bug, please report it"
                )
            return []
        now = time.time()
        chunks = order_chunks(plan.chunks)
        rows: list[int] = []
        sample_chunks: list[tuple[ScheduledChunk, int]] = []
        prompt_spans: list[tuple[_Group, int, int, int]] = []  # group, first pos, count, row
        offset = 0
        for chunk in chunks:
            group, sample = self._owner[chunk.request.request_id]
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            pl = group.prompt_logprobs
            if pl is not None and sample.index == 0:
                first = max(chunk.start, len(pl) - 1)
                last = min(chunk.end, len(group.prompt_token_ids) - 1)
                if last > first:
                    prompt_spans.append((group, first, last - first, len(rows)))
                    rows.extend(offset + p - chunk.start for p in range(first, last))
            if chunk.completes_prompt:
                sample_chunks.append((chunk, len(rows)))
                rows.append(offset + chunk.num_new_tokens - 1)
            offset += chunk.num_new_tokens
        inputs = step_inputs(chunks, rows, self.config.block_size, plan.cache_ops)
        logits = self.executor.execute(inputs.pack())

        sampled: dict[str, int] = {}
        sampler_out = None
        if sample_chunks:
            sample_rows = []
            for chunk, _ in sample_chunks:
                group, sample = self._owner[chunk.request.request_id]
                sample_rows.append(
                    SamplingRow(
                        group.params,
                        sample.generator,
                        group.prompt_token_ids,
                        chunk.request.output_token_ids,
                    )
                )
            index = torch.tensor([r for _, r in sample_chunks], device=logits.device)
            sampler_out = self.sampler(logits[index], sample_rows)
            for i, (chunk, _) in enumerate(sample_chunks):
                sampled[chunk.request.request_id] = sampler_out.token_ids[i]
        if prompt_spans:
            self._record_prompt_logprobs(logits, prompt_spans)

        advanced = self.scheduler.update(plan, sampled)
        touched: dict[str, _Group] = {}
        positions = {c.request.request_id: i for i, (c, _) in enumerate(sample_chunks)}
        for request in advanced:
            group, sample = self._owner[request.request_id]
            self._on_token(group, sample, sampler_out, positions[request.request_id], now)
            touched[group.request_id] = group
        for group, *_ in prompt_spans:
            touched.setdefault(group.request_id, group)
        outputs = []
        for group in touched.values():
            if group.request_id not in self._groups:
                continue
            outputs.append(self._make_output(group))
            if group.finished:
                self._release_group(group)
        return outputs

    def _on_token(
        self, group: _Group, sample: _Sample, out: SamplerOutput, i: int, now: float
    ) -> None:
        request = sample.request
        token = request.output_token_ids[-1]
        self.generation_tokens_total += 1
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        lp = float(out.logprobs[i])
        sample.cumulative_logprob += lp
        if sample.logprobs is not None:
            k = group.params.logprobs or 0
            top = (
                (out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist())
                if k and out.top_ids is not None
                else ([], [])
            )
            sample.logprobs.append(self._logprob_entry(token, lp, int(out.ranks[i]), *top))
        delta = sample.detokenizer.add(token)
        stops = group.params.stop
        if stops and not request.is_finished and delta:
            hit = find_stop(sample.detokenizer.text, len(delta), stops)
            if hit is not None:
                idx, stop = hit
                sample.text_end = (
                    idx + len(stop) if group.params.include_stop_str_in_output else idx
                )
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop)
        if request.is_finished:
            sample.finish_reason = request.status.value
            if group.finished:
                group.metrics.finished_time = now

    def _record_prompt_logprobs(
        self, logits: torch.Tensor, spans: list[tuple[_Group, int, int, int]]
    ) -> None:
        for group, first, count, row in spans:
            lps = logits[row : row + count].log_softmax(-1)
            targets = torch.tensor(
                group.prompt_token_ids[first + 1 : first + 1 + count], device=lps.device
            )
            chosen = lps.gather(1, targets[:, None]).squeeze(1)
            ranks = (lps > chosen[:, None]).sum(-1) + 1
            k = group.params.prompt_logprobs or 0
            top = lps.topk(k, dim=-1) if k else None
            for j in range(count):
                alternatives = (
                    (top.indices[j].tolist(), top.values[j].tolist())
                    if top is not None
                    else ([], [])
                )
                group.prompt_logprobs.append(
                    self._logprob_entry(
                        int(targets[j]), float(chosen[j]), int(ranks[j]), *alternatives
                    )
                )

    def _logprob_entry(
        self,
        token_id: int,
        logprob: float,
        rank: int,
        top_ids: list[int],
        top_logprobs: list[float],
    ) -> dict[int, Logprob]:
        """One position's logprobs: the actual token, then the top alternatives by rank."""
        entry = {token_id: Logprob(logprob, rank, self._decode_one(token_id))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), 1):
            entry.setdefault(tid, Logprob(lp, r, self._decode_one(tid)))
        return entry

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _visible_text(self, group: _Group, sample: _Sample) -> str:
        text = sample.detokenizer.text
        if sample.text_end is not None:
            return text[: sample.text_end]
        if sample.finish_reason is None and group.params.stop:
            # Hold back what could still turn out to be the start of a stop string.
            hold = max(len(s) for s in group.params.stop) - 1
            return text[: len(text) - hold] if hold else text
        return text

    def _make_output(self, group: _Group) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=self._visible_text(group, s),
                token_ids=list(s.request.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.request.stop_reason,
            )
            for s in group.samples
        ]
        prompt_done = group.prompt_logprobs is None or len(group.prompt_logprobs) >= len(
            group.prompt_token_ids
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs if prompt_done else None,
            outputs=outputs,
            finished=group.finished,
            metrics=group.metrics,
            num_cached_tokens=group.samples[0].request.num_cached_tokens,
        )

    def _release_group(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for sample in group.samples:
            self._owner.pop(sample.request.request_id, None)
