"""The contract between scheduler and model runner: StepPlan in, sampled tokens back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ssmserve.scheduler.request import Request


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, starting at `start` (= computed so far)."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One new token on top of computed ones: the one-token SSM update path."""
        return self.num_new_tokens == 1 and self.start > 0

    @property
    def completes_prompt(self) -> bool:
        """True when after this chunk every known token is computed: sample a new one."""
        return self.end == self.request.num_tokens


@dataclass
class StepPlan:
    """One step's work, in flat-batch order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
