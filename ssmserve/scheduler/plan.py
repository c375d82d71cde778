"""The contract between scheduler and model runner: StepPlan in, sampled tokens back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ssmserve.scheduler.request import Request


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, starting at `start` (= computed so far).

    `samples`: after this chunk every token of the request is computed, so a new token is
    sampled from its last position. `epoch` is the request's preemption count when the
    chunk was planned: a chunk from before a preemption is stale and its token is dropped.
    `snapshots` (prefix caching) lists (k, row): the SSM scans write the state after the
    chunk's first k tokens into checkpoint row `row`, for 0 < k < num_new_tokens.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool = False
    epoch: int = 0
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token on top of computed ones: the one-token SSM update path."""
        return self.num_new_tokens == 1 and self.start > 0

    @property
    def is_current(self) -> bool:
        """Whether the request still runs as planned (not finished, aborted or preempted)."""
        return self.request.is_running and self.request.num_preemptions == self.epoch


@dataclass
class CacheOps:
    """Copies the model runner makes in every layer's caches before a step's forward, in
    this order (prefix caching): saves before restores, so a step may restore a state
    that it saves."""

    state_saves: list[tuple[int, int]] = field(default_factory=list)  # (slot, checkpoint row)
    state_restores: list[tuple[int, int]] = field(default_factory=list)  # (row, slot)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination)


@dataclass
class StepPlan:
    """One step's work, in flat-batch order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    cache_ops: CacheOps = field(default_factory=CacheOps)
    # What the prefix cache holds for this step until the scheduler's update (opaque).
    cache_locks: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks
