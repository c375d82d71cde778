"""The contract between scheduler and model runner: StepPlan in, sampled tokens back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ssmserve.scheduler.request import Request


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, starting at `start` (= computed so far).

    `samples`: after this chunk every token of the request is computed, so a new token is
    sampled from its last position. `epoch` is the request's preemption count when the
    chunk was planned: a chunk from before a preemption is stale and its token is dropped.
    """

    request: Request
    start: int
    num_new_tokens: int
    samples: bool = False
    epoch: int = 0

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
class StepPlan:
    """One step's work, in flat-batch order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
