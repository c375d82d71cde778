"""SamplingParams: how one request is sampled and when it stops (vLLM-shaped)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by them overflows (vLLM's rule too).
GREEDY_TEMPERATURE_BELOW = 1e-5
# Seeds are 64-bit integers, signed (as OpenAI's API types them) or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)
# top_k above the largest vocabulary anyone trains is a mistake, not a wish for "off".
MAX_TOP_K = 2**31 - 1


def with_defaults(given: dict, defaults: dict | None) -> dict:
    """`given` (None = unset) with each unset field taken from `defaults` (a model's
    generation_config.json); fields unset in both are left out, for SamplingParams'
    own defaults."""
    defaults = defaults or {}
    merged = {k: defaults.get(k) if v is None else v for k, v in given.items()}
    return {k: v for k, v in merged.items() if v is not None}


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """Per-request sampling settings. Invalid values raise ValueError with a fix.

    temperature 0 means greedy; a temperature below 1e-5 is greedy too (it is set to 0).
    top_k <= 0 (or -1) and top_p = 1 and min_p = 0 disable those filters. `logprobs` is the
    number of top alternatives returned per generated token (the sampled token is always
    included); `prompt_logprobs` likewise per prompt token.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine: the model's EOS ids, used unless ignore_eos.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self._validate()
        if self.temperature < GREEDY_TEMPERATURE_BELOW:
            self.temperature = 0.0

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 0.0 <= self.temperature < math.inf:
            bad(f"temperature must be >= 0 and finite (0 means greedy), got {self.temperature}")
        if self.top_k > MAX_TOP_K:
            bad(f"top_k must be at most {MAX_TOP_K} (or -1 or 0 for off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty < math.inf:
            bad(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            bad(f"seed must be in [-2**63, 2**64 - 1] (a 64-bit integer), got {self.seed}")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
