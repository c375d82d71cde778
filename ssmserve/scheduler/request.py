"""A request as the scheduler sees it: token counters, cache handles, status. Pure Python."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    """One sequence being generated. There are no phases, only counters.

    `num_computed_tokens` tokens have been scheduled through the model (their K/V go to
    the cache, their effect to the state slot). A planned chunk that reaches the end of
    the request samples a new token; until that step's result is back the token is
    pending (`num_pending_tokens`), counted in `num_tokens` but not yet in
    `all_token_ids`. The engine plans a step while the previous one runs, so up to two
    tokens can be pending.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        use_prefix_cache: bool = True,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.arrival_index = -1  # set by the scheduler when the request is added
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        # Tokens whose step has run and been collected (num_computed_tokens also counts
        # planned chunks still in flight).
        self.num_settled_tokens = 0
        # Tokens whose chunks have been launched (what the state slot holds once the
        # steps in flight are done); planned chunks not launched yet are not counted.
        self.num_launched_tokens = 0
        self.block_ids: list[int] = []
        self.state_slot: int | None = None
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Prefix caching: whether admission may resume from cached tokens (not when every
        # prompt position's logits are wanted), how many the first admission found, and
        # how many leading blocks are registered by content.
        self.use_prefix_cache = use_prefix_cache
        self.num_cached_tokens = 0
        self.num_committed_blocks = 0

    @property
    def num_tokens(self) -> int:
        """Tokens known or being sampled."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def is_running(self) -> bool:
        return self.status == RequestStatus.RUNNING

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        """A pending token's value has arrived."""
        self.num_pending_tokens -= 1
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed="
            f"{self.num_computed_tokens}/{self.num_tokens}, slot={self.state_slot}, "
            f"blocks={len(self.block_ids)})"
        )
