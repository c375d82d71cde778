"""Paged KV-cache blocks for attention layers. Pure Python: ids only, no tensors."""

from __future__ import annotations

from collections import OrderedDict, deque

# A full block's content key: (content id of the block before it, or -1 for the first
# block; the block's token ids). Content ids are never reused, so a key is exact: two
# blocks share a key only if they hold the same tokens after the same prefix.
BlockKey = tuple[int, tuple[int, ...]]


class BlockPool:
    """`num_blocks` KV block ids shared by all attention layers, reference-counted.

    Every attention layer holds its own tensor of `num_blocks` blocks; one id names the
    same block position in each of them, so one block table serves all layers.

    A block is held by requests (`acquire` / `free`) and pinned by prefix-cache
    checkpoints (`pin` / `unpin`). With `enable_caching`, full blocks are
    content-addressed (`commit`): a block that nothing holds any more keeps its content
    and stays findable by `cached_prefix` until an allocation needs it, least recently
    freed first. Without it, a freed block goes straight back to the free list.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._holders = [0] * num_blocks  # requests holding the block
        self._pins = [0] * num_blocks  # checkpoints pinning the block
        self._num_held = 0  # blocks with at least one holder
        # Unreferenced blocks with content, oldest first: evicted from the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._key_of: dict[int, BlockKey] = {}
        self._content_id: dict[int, int] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._next_content_id = 0

    # -- accounting ------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free or cached without references)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self._num_held

    @property
    def num_cached(self) -> int:
        """Blocks with content that no request holds (pinned by checkpoints or evictable)."""
        return self.num_blocks - len(self._free) - self._num_held

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation and references ---------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks for a request, or none at all (returns None) if fewer can be
        had; cached blocks nobody references are evicted for it, oldest first."""
        if n > self.num_free:
            return None
        taken = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
            taken.append(block)
        self._hold(taken)
        return taken

    def acquire(self, block_ids: list[int]) -> None:
        """Add a request's reference to blocks that already have content (a cache hit)."""
        for block in block_ids:
            self._evictable.pop(block, None)
        self._hold(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop a request's references. Later blocks of a sequence are given back first,
        so they are evicted before the prefix they extend."""
        for block in reversed(block_ids):
            assert self._holders[block] > 0, f"block {block} freed more often than held"
            self._holders[block] -= 1
            if self._holders[block] == 0:
                self._num_held -= 1
                self._release_if_unreferenced(block)

    def pin(self, block_ids: list[int]) -> None:
        """A checkpoint's reference: the blocks keep their content while it lives."""
        for block in block_ids:
            self._evictable.pop(block, None)
            self._pins[block] += 1

    def unpin(self, block_ids: list[int]) -> None:
        for block in reversed(block_ids):
            assert self._pins[block] > 0, f"block {block} unpinned more often than pinned"
            self._pins[block] -= 1
            self._release_if_unreferenced(block)

    def _hold(self, block_ids: list[int]) -> None:
        for block in block_ids:
            if self._holders[block] == 0:
                self._num_held += 1
            self._holders[block] += 1

    def _release_if_unreferenced(self, block: int) -> None:
        if self._holders[block] or self._pins[block]:
            return
        if block in self._key_of:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def clear_cached(self) -> None:
        """Forget the content of every block nothing references (they become free)."""
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self._free.append(block)

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            del self._content_id[block]

    # -- content addressing ------------------------------------------------------------

    def _key(self, parent: int, tokens: list[int], index: int) -> BlockKey:
        size = self.block_size
        return parent, tuple(tokens[index * size : (index + 1) * size])

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """Ids of the cached full blocks that hold `tokens` from the start, in order (as
        many leading blocks as are cached)."""
        found: list[int] = []
        if not self.enable_caching:
            return found
        parent = -1
        for index in range(len(tokens) // self.block_size):
            block = self._block_of.get(self._key(parent, tokens, index))
            if block is None:
                break
            found.append(block)
            parent = self._content_id[block]
        return found

    def commit(self, block_ids: list[int], tokens: list[int], start: int, end: int) -> None:
        """Register blocks [start, end) of a request as full, with their tokens.

        `block_ids` is the request's block table (edited in place) and `tokens` its
        token ids; blocks before `start` must be committed already. A block whose
        content is cached already under another id is replaced by that one, so a shared
        prefix is stored once: the request's copy goes back to the pool.
        """
        if not self.enable_caching:
            return
        parent = self._content_id[block_ids[start - 1]] if start > 0 else -1
        for index in range(start, end):
            key = self._key(parent, tokens, index)
            mine = block_ids[index]
            cached = self._block_of.get(key)
            if cached is None:
                if mine not in self._key_of:
                    self._key_of[mine] = key
                    self._block_of[key] = mine
                    self._content_id[mine] = self._next_content_id
                    self._next_content_id += 1
                # else: the same content is registered under another chain (its first
                # registration was evicted and made again); `mine` keeps that key.
                cached = mine
            elif cached != mine:
                self.acquire([cached])
                self.free([mine])
                block_ids[index] = cached
            parent = self._content_id[cached]
