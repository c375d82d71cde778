"""Tensor-parallel state handed to every layer: rank, size, and the collectives layers use.

Layers get a `TensorParallel` when they are built (no process-wide parallel state). At
size 1 every collective is the identity, so the TP=1 path costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """One rank's view of its tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # the model's collectives (NCCL on CUDA)
    cpu_group: dist.ProcessGroup | None = None  # gloo, for host-side agreement

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns x."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def shard_range(n: int, size: int, rank: int) -> range:
    """The units of `n` that `rank` of `size` holds: contiguous, as even as possible
    (the first n % size ranks hold one more)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def divisors_up_to(n: int, limit: int = 64) -> list[int]:
    """Tensor-parallel sizes that divide `n` (for error messages)."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def require_divisible(what: str, n: int, tp: TensorParallel) -> None:
    """Raise a clear error when `n` units of `what` cannot be split over tp.size ranks."""
    if n % tp.size:
        raise ValueError(
            f"{what} = {n} does not split over tensor_parallel_size = {tp.size}; valid sizes "
            f"for this model divide {n}: {', '.join(map(str, divisors_up_to(n)))}"
        )
