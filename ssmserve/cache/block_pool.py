"""Paged KV-cache blocks for attention layers. Pure Python: ids only, no tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list of `num_blocks` KV block ids shared by all attention layers.

    Every attention layer holds its own tensor of `num_blocks` blocks; one id names the
    same block position in each of them, so one block table serves all layers.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks, or none at all (returns None) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
