"""Split a byte budget between SSM state slots and KV blocks. Pure Python."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachePlan:
    num_kv_blocks: int
    num_state_slots: int
    max_num_seqs: int
    max_tokens_per_request: int  # min(max_model_len, what the KV cache can hold)
    num_state_checkpoints: int = 0  # prefix caching: state rows after the slots


def plan_cache(
    *,
    budget_bytes: int,
    bytes_per_block: int,
    bytes_per_slot: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    num_kv_blocks: int | None = None,
    checkpoint_fraction: float = 0.0,
    num_checkpoints: int | None = None,
) -> CachePlan:
    """Give every one of `max_num_seqs` requests a state slot, state checkpoints their
    share, and the rest to KV blocks.

    A model without attention layers has bytes_per_block == 0 (no KV pool); one without
    SSM layers has bytes_per_slot == 0 (no state pool). Where the slots do not fit beside
    the KV blocks one request of max_model_len needs, max_num_seqs is lowered with a
    warning rather than failing. `num_kv_blocks` overrides the KV share.

    Prefix-caching checkpoints (a slot's size each) get `checkpoint_fraction` of the
    budget, from what the slots and that minimal KV cache leave; a model without
    attention gives them all that the slots leave (nothing else could use it).
    `num_checkpoints` overrides their number.
    """
    has_kv, has_state = bytes_per_block > 0, bytes_per_slot > 0
    if has_kv:
        min_blocks = -(-max_model_len // block_size)
        kv_bytes = (num_kv_blocks if num_kv_blocks is not None else min_blocks) * bytes_per_block
    else:
        kv_bytes = 0
    slots = max_num_seqs
    if has_state:
        fit = max(budget_bytes - kv_bytes, 0) // bytes_per_slot
        if num_kv_blocks is not None:
            fit = max(fit, 1)  # an explicit override is the user's call; keep one slot
        if fit < 1:
            raise ValueError(
                f"the cache budget ({budget_bytes / 2**20:.1f} MiB) cannot hold one SSM state "
                f"slot ({bytes_per_slot / 2**20:.2f} MiB) beside the KV cache for one request of "
                f"max_model_len={max_model_len}; raise cache_memory / gpu_memory_utilization "
                "or lower max_model_len"
            )
        if fit < max_num_seqs:
            logger.warning(
                "only %d SSM state slots fit in the cache budget; lowering max_num_seqs from "
                "%d to %d (raise cache_memory / gpu_memory_utilization to run more at once)",
                fit,
                max_num_seqs,
                fit,
            )
            slots = int(fit)
    rows = 0
    if has_state and num_checkpoints is not None:
        rows = num_checkpoints
    elif has_state and checkpoint_fraction > 0:
        left = max(budget_bytes - kv_bytes - slots * bytes_per_slot, 0)
        share = int(budget_bytes * checkpoint_fraction) if has_kv else left
        rows = min(share, left) // bytes_per_slot
    if has_kv:
        if num_kv_blocks is None:
            state_bytes = (slots + rows) * bytes_per_slot
            num_kv_blocks = (budget_bytes - state_bytes) // bytes_per_block
            if num_kv_blocks < 1:
                raise ValueError(
                    f"{rows} state checkpoints and {slots} state slots leave no room for KV "
                    "blocks in the cache budget; lower num_prefix_checkpoints"
                )
        max_tokens = min(max_model_len, num_kv_blocks * block_size)
    else:
        num_kv_blocks, max_tokens = 0, max_model_len
    return CachePlan(
        num_kv_blocks=int(num_kv_blocks),
        num_state_slots=slots if has_state else 0,
        max_num_seqs=slots,
        max_tokens_per_request=int(max_tokens),
        num_state_checkpoints=int(rows),
    )


def combine_plans(plans: list[CachePlan]) -> CachePlan:
    """The plan every pipeline stage can hold: the fewest KV blocks among the stages that
    have attention layers, the fewest state slots among those that have SSM layers."""
    if len(plans) == 1:
        return plans[0]
    kv = [p.num_kv_blocks for p in plans if p.num_kv_blocks]
    with_state = [p for p in plans if p.num_state_slots]
    return CachePlan(
        num_kv_blocks=min(kv, default=0),
        num_state_slots=min((p.num_state_slots for p in with_state), default=0),
        max_num_seqs=min(p.max_num_seqs for p in plans),
        max_tokens_per_request=min(p.max_tokens_per_request for p in plans),
        num_state_checkpoints=min((p.num_state_checkpoints for p in with_state), default=0),
    )
