"""Continuous-batching scheduler: counters, not phases. Pure Python (no torch)."""

from __future__ import annotations

import itertools
import logging
from collections import deque

from ssmserve.cache import BlockPool, PrefixCache, PrefixHit, StatePool
from ssmserve.scheduler.plan import ScheduledChunk, StepPlan
from ssmserve.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# A waiting request holds back for a running one's checkpoints only to save at least
# this many tokens: waiting costs it (and the queue behind it) a step, and a few dozen
# tokens (a chat template's header) cost less to compute again.
MIN_WAIT_GAIN = 64


class Scheduler:
    """Builds one StepPlan per step within the token budget and the cache.

    Order of service: running requests with one token left (decodes), then running
    requests still prefilling, then waiting requests in arrival order (preempted ones
    first). A prompt longer than the budget is split wherever the budget falls. When KV
    blocks run out, the newest running request is preempted: it gives back its blocks and
    state slot and is recomputed later (its output so far becomes prompt). With a
    `prefix_cache`, an admitted request resumes from the deepest cached prefix of its
    tokens, and the plan carries the cache copies and snapshots the step makes.

    NOTE: `running` stays in arrival order, and every running request arrived before every
    waiting one (admission is FIFO and preempted requests wait at the front), so
    `running[-1]` is always the newest request holding cache.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_tokens_per_request: int,
        block_pool: BlockPool | None,
        state_pool: StatePool | None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_tokens_per_request = max_tokens_per_request
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.arrival_index = next(self._arrivals)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; frees its blocks and slot. None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(
        self, request: Request, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        assert status.finished
        if (
            self.prefix_cache is not None
            and request.status == RequestStatus.RUNNING
            and status != RequestStatus.FINISHED_ABORTED
        ):
            # What a follow-up turn needs: the state after everything but the last token,
            # or after every token when a step launched before this one's result came
            # back has fed the last one in already. The slot holds the state after the
            # launched chunks (a chunk planned and not launched is dropped, not run).
            position = min(request.num_launched_tokens, len(request.all_token_ids))
            self.prefix_cache.save(request, position)
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self._release(request)
        request.status = status
        request.stop_reason = stop_reason
        self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning ----------------------------------------------------------------

    def schedule(self, allow_pending: bool = True) -> StepPlan:
        """Plan the next step. Counters advance here, so the engine can plan a step while
        the previous one is still running: a chunk that reaches the end of its request
        leaves a pending token, which `update` fills in when it is sampled.

        `allow_pending=False` (several steps in a pipeline at once) leaves out requests
        waiting for a pending token: a request is in one in-flight step at a time.
        """
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        chunks: dict[str, ScheduledChunk] = {}

        for decodes in (True, False):
            for request in list(self.running):
                if budget == 0:
                    break
                if not request.is_running or request.request_id in chunks:
                    continue
                if request.num_pending_tokens and not allow_pending:
                    continue
                remaining = request.num_tokens - request.num_computed_tokens
                if remaining == 0 or (remaining == 1) != decodes or self._will_finish(request):
                    continue
                n = self._chunk_tokens(request, budget)
                while not self._reserve_blocks(request, n):
                    # NOTE: the victim is always the newest arrival, never an older request
                    # than the one asking; two requests preempting each other by turns
                    # would livelock. The oldest running request always makes progress.
                    victim = self.running[-1]
                    if victim is request:
                        if self.prefix_cache is not None and self.prefix_cache.num_locking_steps:
                            # Blocks a step in flight holds (a copy source, a checkpoint
                            # it writes) come back when it is done: wait, not restart.
                            break
                        self._preempt(request, plan)
                        break
                    victim_chunk = chunks.pop(victim.request_id, None)
                    if victim_chunk is not None:
                        plan.chunks.remove(victim_chunk)
                        budget += victim_chunk.num_new_tokens
                    self._preempt(victim, plan)
                else:
                    chunks[request.request_id] = self._plan_chunk(request, n, plan)
                    budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.state_pool is not None and self.state_pool.num_free == 0:
                break
            hit = None
            if self.prefix_cache is not None and request.use_prefix_cache:
                hit = self.prefix_cache.lookup(request.all_token_ids)
                if self._should_wait(request, hit):
                    break
                if hit is not None:
                    self.prefix_cache.hold(hit)
                    request.num_computed_tokens = request.num_settled_tokens = hit.position
                    request.block_ids = list(hit.blocks)
            n = self._chunk_tokens(request, budget)
            admitted = self._reserve_blocks(request, n)
            if not admitted and hit is not None:
                # The hit's own blocks can be what is in the way (its partial block is
                # copied into one more): without it, evicting its checkpoint may fit.
                self.prefix_cache.unhold(hit)
                request.num_computed_tokens = request.num_settled_tokens = 0
                request.block_ids = []
                hit = None
                n = self._chunk_tokens(request, budget)
                admitted = self._reserve_blocks(request, n)
            if not admitted:
                break  # never preempt a running request to admit a waiting one
            self.waiting.popleft()
            if self.state_pool is not None:
                request.state_slot = self.state_pool.allocate()
            if self.prefix_cache is not None and request.use_prefix_cache:
                self._resume(request, hit, plan)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks[request.request_id] = self._plan_chunk(request, n, plan)
            budget -= n
        if self.prefix_cache is not None and plan.chunks:
            self.prefix_cache.plan_step(plan)
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[Request]:
        """Fill in the tokens a finished step sampled; apply token stops.

        `sampled` maps request id -> new token for every chunk of `plan` that samples.
        Chunks whose request was finished, aborted or preempted since are skipped (a
        preempted request recomputes and samples again). Returns the requests that got a
        new token (finished ones included).
        """
        if self.prefix_cache is not None:
            self.prefix_cache.step_done(plan)
        advanced = []
        for chunk in plan.chunks:
            if not chunk.is_current:
                continue
            request = chunk.request
            request.num_settled_tokens = chunk.end
            if self.prefix_cache is not None:
                self.prefix_cache.chunk_done(chunk)
            if not chunk.samples:
                continue
            token = sampled[request.request_id]
            request.append_output_token(token)
            advanced.append(request)
            status, reason = self._check_token_stop(request, token)
            if status is not None:
                self.finish_request(request, status, reason)
        return advanced

    def before_launch(self, plan: StepPlan) -> None:
        """Just before a planned step runs (its chunks still current): the state saves
        queued since the step before was launched go first in its cache copies, while
        the slots still hold those states."""
        if self.prefix_cache is not None:
            self.prefix_cache.take_queued_saves(plan)

    def after_launch(self, plan: StepPlan) -> None:
        """Just after a step was launched: its chunks' effect will be in their slots
        when the next step runs, so the states to keep at their ends are queued now (the
        next step's copies make them, before it advances a slot again)."""
        for chunk in plan.chunks:
            chunk.request.num_launched_tokens = chunk.end
            if self.prefix_cache is not None:
                self.prefix_cache.chunk_launched(chunk)

    def discard(self, plan: StepPlan, dropped: list[ScheduledChunk]) -> None:
        """Chunks of `plan` that will not run (their request finished since it was
        planned); with no chunk left, the plan itself, whose holds are released."""
        if self.prefix_cache is None:
            return
        for chunk in dropped:
            self.prefix_cache.discard_snapshots(chunk, plan)
        if not [c for c in plan.chunks if c not in dropped]:
            self.prefix_cache.step_done(plan)

    # -- internals ---------------------------------------------------------------

    def _check_token_stop(
        self, request: Request, token: int
    ) -> tuple[RequestStatus | None, int | None]:
        if request.num_output_tokens >= request.min_tokens:
            if token in request.stop_token_ids or token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if len(request.all_token_ids) >= self.max_tokens_per_request:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _plan_chunk(self, request: Request, n: int, plan: StepPlan) -> ScheduledChunk:
        start = request.num_computed_tokens
        samples = start + n == request.num_tokens
        chunk = ScheduledChunk(request, start, n, samples, request.num_preemptions)
        request.num_computed_tokens += n
        request.num_pending_tokens += samples
        plan.chunks.append(chunk)
        return chunk

    def _will_finish(self, request: Request) -> bool:
        """Whether the tokens already pending end the request by length: planning more
        for it would only compute tokens to throw away."""
        if not request.num_pending_tokens:
            return False
        return (
            request.num_output_tokens + request.num_pending_tokens >= request.max_tokens
            or request.num_tokens >= self.max_tokens_per_request
        )

    def _chunk_tokens(self, request: Request, budget: int) -> int:
        """Tokens of `request` to compute now. With prefix caching on a model with SSM
        state, a prompt's prefill stops one token short of the end, so the state after
        all but the last token (what a repeat of the prompt resumes from) is in the slot
        after a step; the last token is computed in the next step."""
        computed, last = request.num_computed_tokens, request.num_tokens - 1
        n = min(request.num_tokens - computed, budget)
        if self.prefix_cache is not None and self.prefix_cache.has_state and computed < last:
            n = min(n, last - computed)
        return n

    def _should_wait(self, request: Request, hit: PrefixHit | None) -> bool:
        """True when a running request is still prefilling tokens this one shares, and
        will leave a deeper checkpoint than it could resume from now (samples of one
        prompt, many requests on one system prompt): admitting it later computes the
        shared tokens once."""
        if not self.prefix_cache.can_hit:
            return False
        current = hit.position if hit is not None else 0
        tokens = request.all_token_ids
        # A wait pays only if `other` shares tokens[:current + MIN_WAIT_GAIN] (the reach
        # never passes the common prefix): comparing that window first skips the full
        # comparison for nearly every pair (many requests on one system prompt).
        last = current + MIN_WAIT_GAIN
        if last > len(tokens) - 1:
            return False
        window = tokens[current:last]
        for other in self.running:
            end = other.num_tokens - 1
            if other.num_settled_tokens >= end or end < last:
                continue
            if other.all_token_ids[current:last] != window:
                continue
            reach = self.prefix_cache.potential_hit(tokens, other.all_token_ids, end)
            if reach - current >= MIN_WAIT_GAIN and other.num_settled_tokens < reach:
                return True
        return False

    def _resume(self, request: Request, hit: PrefixHit | None, plan: StepPlan) -> None:
        """Put an admitted request's hit (if any) into the plan; count the lookup."""
        cached = hit.position if hit is not None else 0
        if hit is not None:
            self.prefix_cache.use(hit, request.block_ids, request.state_slot, plan)
        self.prefix_cache.count_query(request.num_tokens, cached)
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached

    def _allocate_blocks(self, n: int) -> list[int] | None:
        if self.prefix_cache is not None:
            return self.prefix_cache.allocate_blocks(n)
        return self.block_pool.allocate(n)

    def _reserve_blocks(self, request: Request, num_new_tokens: int) -> bool:
        if self.block_pool is None:
            return True
        needed = self.block_pool.blocks_for(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return True
        block_ids = self._allocate_blocks(missing)
        if block_ids is None:
            return False
        request.block_ids.extend(block_ids)
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        logger.debug("preempting %s", request)
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_settled_tokens = 0
        request.num_pending_tokens = 0  # an in-flight token is dropped, then recomputed
        request.num_launched_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    def _release(self, request: Request) -> None:
        if self.block_pool is not None and request.block_ids:
            self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_committed_blocks = 0
        if self.state_pool is not None and request.state_slot is not None:
            self.state_pool.free(request.state_slot)
        request.state_slot = None
