"""Prefix caching: what a new request can resume from, and what to keep. Pure Python.

A `Checkpoint` stands for a token prefix of `position` tokens whose effect on the model
is kept: the conv + SSM state after it in a checkpoint row of the state tensors (models
with SSM layers), and the KV blocks that hold it (models with attention; the blocks are
pinned for as long as the checkpoint lives). Checkpoints are found through a radix tree
over token ids, so a hit can end at any token. Full KV blocks are also content-addressed
in the block pool, which is all a pure-attention model needs for block-aligned hits.

A checkpoint goes through three states:

- WRITING: the scan kernels of a step write it (a chunk boundary inside a prefill
  chunk); not readable until the scheduler's update for that step.
- QUEUED: a copy from a request's state slot, made first thing in the next step that
  runs (the slot holds the state until that step's forward). Restores come after the
  saves in a step, so the step that makes the copy may already restore from it.
- READY: readable.

A checkpoint that a step in flight reads or writes is locked (`users`) and never
evicted. Eviction takes the least recently used checkpoint (made or hit) first. Every
checkpoint holds its own state row and pins all of its blocks, so evicting one never
spoils another, a deeper one on the same prefix included; and in chat traffic the
deepest checkpoint of a conversation (its last turn's end) is the one its next turn
needs, while the earlier ones on its path go stale.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from ssmserve.cache.block_pool import BlockPool
from ssmserve.cache.radix_tree import Node, RadixTree, common_prefix_length

logger = logging.getLogger(__name__)

WRITING, QUEUED, READY = "writing", "queued", "ready"


@dataclass(eq=False)
class Checkpoint:
    position: int
    row: int | None  # checkpoint row of the state tensors (None: no SSM layers)
    block_ids: list[int]  # KV blocks holding tokens [0, position), pinned
    node: Node
    state: str
    users: int = 0  # steps in flight that read or write it


@dataclass
class PrefixHit:
    """Where a request resumes: `position` tokens are already computed."""

    position: int
    blocks: list[int]  # full KV blocks of tokens [0, position // block_size * block_size)
    copy_source: int | None  # block holding the rest of [0, position), copied on write
    checkpoint: Checkpoint | None  # the state to restore (SSM layers), or None


@dataclass
class PendingSave:
    """A QUEUED checkpoint: copy state slot `slot` into `checkpoint.row`."""

    slot: int
    checkpoint: Checkpoint


@dataclass
class StepLocks:
    """What one step in flight reads or writes, released when it is done."""

    checkpoints: list[Checkpoint] = field(default_factory=list)
    written: list[Checkpoint] = field(default_factory=list)  # WRITING until the step ran
    blocks: list[int] = field(default_factory=list)  # copy sources held by the step


class PrefixCache:
    """Lookups, snapshots and eviction for prefix caching.

    `block_pool` is the KV pool (None without attention layers); state checkpoint rows
    are `num_slots .. num_slots + num_checkpoints - 1` of every SSM layer's state
    tensors (`has_state` False: no SSM layers, no rows). Inside a prefill chunk, SSM
    state is snapshotted at multiples of `interval` tokens.
    """

    def __init__(
        self,
        *,
        block_pool: BlockPool | None,
        has_state: bool,
        num_slots: int,
        num_checkpoints: int,
        interval: int,
    ) -> None:
        if interval < 1:
            raise ValueError(f"the checkpoint interval must be positive, got {interval}")
        self.block_pool = block_pool
        self.has_state = has_state
        self.interval = interval
        self.num_rows = num_checkpoints if has_state else 0
        self._free_rows = list(range(num_slots + self.num_rows - 1, num_slots - 1, -1))
        self.tree = RadixTree()
        # Every checkpoint, least recently used first.
        self._lru: OrderedDict[Checkpoint, None] = OrderedDict()
        self._queued: list[PendingSave] = []
        self.query_tokens = 0
        self.hit_tokens = 0
        self.num_locking_steps = 0  # planned steps holding locks, not yet done

    def _locks(self, plan) -> StepLocks:
        if plan.cache_locks is None:
            plan.cache_locks = StepLocks()
            self.num_locking_steps += 1
        return plan.cache_locks

    # -- accounting ------------------------------------------------------------------

    @property
    def num_checkpoints(self) -> int:
        return len(self._lru)

    @property
    def can_hit(self) -> bool:
        """False for a model with SSM layers but no room for state checkpoints."""
        return not self.has_state or self.num_rows > 0

    @property
    def num_rows_used(self) -> int:
        return self.num_rows - len(self._free_rows)

    def all_evictable(self) -> bool:
        """True when no step in flight reads or writes any checkpoint."""
        return all(c.users == 0 and c.state != WRITING for c in self._lru)

    def clear(self) -> int:
        """Evict every checkpoint no step uses, and forget the content of every KV block
        nothing references; returns how many checkpoints could not be evicted."""
        for checkpoint in list(self._lru):
            if self._evictable(checkpoint):
                self._evict(checkpoint)
        if self.block_pool is not None:
            self.block_pool.clear_cached()
        return len(self._lru)

    # -- lookups ---------------------------------------------------------------------

    def lookup(self, tokens: list[int]) -> PrefixHit | None:
        """The deepest usable prefix of `tokens` (leaving at least one token to compute:
        its logits are what a request needs), or None."""
        limit = len(tokens) - 1
        if limit < 1:
            return None
        checkpoint = self.tree.deepest(tokens, limit, lambda c: c.state != WRITING)
        position = checkpoint.position if checkpoint is not None else 0
        pool = self.block_pool
        if pool is not None and not self.has_state:
            # Attention only: cached full blocks serve without a checkpoint.
            chain = pool.cached_prefix(tokens)
            chained = min(len(chain) * pool.block_size, limit)
            if chained > position:
                return self._hit(chained, chain, None)
        if checkpoint is None:
            return None
        return self._hit(position, checkpoint.block_ids, checkpoint)

    def _hit(self, position: int, blocks: list[int], checkpoint: Checkpoint | None) -> PrefixHit:
        if self.block_pool is None:
            return PrefixHit(position, [], None, checkpoint)
        full, rest = divmod(position, self.block_pool.block_size)
        return PrefixHit(position, blocks[:full], blocks[full] if rest else None, checkpoint)

    def hold(self, hit: PrefixHit) -> None:
        """Take the hit's blocks for the request (and its copy source and checkpoint for
        the step), so that nothing allocated after this evicts them."""
        if self.block_pool is not None:
            self.block_pool.acquire(hit.blocks)
            if hit.copy_source is not None:
                self.block_pool.acquire([hit.copy_source])
        if hit.checkpoint is not None:
            hit.checkpoint.users += 1

    def unhold(self, hit: PrefixHit) -> None:
        """Undo `hold` (the request could not be admitted after all)."""
        if self.block_pool is not None:
            self.block_pool.free(hit.blocks)
            if hit.copy_source is not None:
                self.block_pool.free([hit.copy_source])
        if hit.checkpoint is not None:
            hit.checkpoint.users -= 1

    def use(self, hit: PrefixHit, block_ids: list[int], slot: int | None, plan) -> None:
        """Record a held hit in the step `plan`: restore the state into `slot`, copy the
        partial block into the request's own block; the step releases the rest."""
        locks = self._locks(plan)
        if hit.checkpoint is not None:
            self._lru.move_to_end(hit.checkpoint)
            locks.checkpoints.append(hit.checkpoint)
            if hit.checkpoint.row is not None:
                plan.cache_ops.state_restores.append((hit.checkpoint.row, slot))
        if hit.copy_source is not None:
            full = len(hit.blocks)
            plan.cache_ops.block_copies.append((hit.copy_source, block_ids[full]))
            locks.blocks.append(hit.copy_source)

    def count_query(self, num_tokens: int, hit: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += hit

    def potential_hit(self, tokens: list[int], producer: list[int], producer_end: int) -> int:
        """How far `tokens` could resume from checkpoints a request computing `producer`
        up to `producer_end` tokens will leave (its chunk boundaries and its end)."""
        shared = min(common_prefix_length(tokens, producer), len(tokens) - 1, producer_end)
        if shared == producer_end:
            return shared
        step = self.interval if self.has_state else self.block_pool.block_size
        return shared // step * step

    # -- blocks ----------------------------------------------------------------------

    def allocate_blocks(self, n: int) -> list[int] | None:
        """`n` KV blocks, evicting checkpoints for their blocks if needed; None (and
        nothing evicted) if the blocks requests hold leave fewer than `n`."""
        pool = self.block_pool
        if n > pool.num_blocks - pool.num_used:
            return None
        while True:
            blocks = pool.allocate(n)
            if blocks is not None:
                return blocks
            victim = self._victim(lambda c: bool(c.block_ids))
            if victim is None:
                return None
            self._evict(victim)

    def commit_blocks(self, request, computed: int) -> None:
        """Register the request's KV blocks that `computed` tokens fill, by content."""
        if self.block_pool is None:
            return
        full = computed // self.block_pool.block_size
        if full > request.num_committed_blocks:
            self.block_pool.commit(
                request.block_ids, request.all_token_ids, request.num_committed_blocks, full
            )
            request.num_committed_blocks = full

    # -- snapshots ---------------------------------------------------------------------

    def plan_step(self, plan) -> None:
        """At the end of planning a step: choose the chunk-boundary snapshots inside its
        prefill chunks."""
        if not self.has_state:
            return
        q = self.interval
        for chunk in plan.chunks:
            request = chunk.request
            for position in range((chunk.start // q + 1) * q, chunk.end, q):
                checkpoint = self._new_checkpoint(request, position, WRITING)
                if checkpoint is None:
                    continue
                checkpoint.users += 1
                self._locks(plan).written.append(checkpoint)
                chunk.snapshots.append((position - chunk.start, checkpoint.row))

    def take_queued_saves(self, plan) -> None:
        """Move the queued saves into the step `plan`, which is about to run: its cache
        copies make them first thing (the engine plans a step while the one before runs,
        so saves that step queued arrive after planning)."""
        if not self._queued:
            return
        locks = self._locks(plan)
        for pending in self._queued:
            pending.checkpoint.state = READY
            pending.checkpoint.users += 1
            locks.checkpoints.append(pending.checkpoint)
            plan.cache_ops.state_saves.append((pending.slot, pending.checkpoint.row))
        self._queued = []

    def discard_snapshots(self, chunk, plan) -> None:
        """A planned chunk will not run: the checkpoints its scans were to write go."""
        rows = {row for _, row in chunk.snapshots}
        written = plan.cache_locks.written if plan.cache_locks is not None else []
        for checkpoint in [c for c in written if c.row in rows]:
            written.remove(checkpoint)
            checkpoint.users -= 1
            self._evict(checkpoint)
        chunk.snapshots.clear()

    def step_done(self, plan) -> None:
        """The step `plan` has run: what it wrote is readable, what it held is free."""
        locks = plan.cache_locks
        if locks is None:
            return
        for checkpoint in locks.written:
            checkpoint.state = READY
            checkpoint.users -= 1
        for checkpoint in locks.checkpoints:
            checkpoint.users -= 1
        if locks.blocks:
            self.block_pool.free(locks.blocks)
        plan.cache_locks = None
        self.num_locking_steps -= 1

    def chunk_launched(self, chunk) -> None:
        """After a chunk was launched: keep the state at its end if that is a checkpoint
        position (a chunk boundary, or the last prompt position before the final token).
        The copy is queued for the next step that runs, which makes it before the slot
        moves on (a step may be launched before the one before it is done)."""
        if not self.has_state:
            return
        request = chunk.request
        # The prompt (and outputs) known at launch: a token the chunk samples is not
        # appended yet, and tokens planned since are not counted.
        end, last = chunk.end, len(request.all_token_ids) - 1
        # NOTE: the slot holds the state at the chunk's end only: the scheduler ends
        # prefill chunks at `last` so that this position gets its checkpoint.
        if end == last or (end < last and end % self.interval == 0):
            self.save(request, end)

    def chunk_done(self, chunk) -> None:
        """After a chunk has run (counters advanced, no token appended yet): register
        full blocks; without SSM layers, keep the KV of the last prompt position before
        the final token as a checkpoint (the blocks hold it once the chunk ran)."""
        request = chunk.request
        self.commit_blocks(request, chunk.end)
        last = len(request.all_token_ids) - 1
        if not self.has_state and chunk.start < last <= chunk.end:
            self.save(request, last)

    def save(self, request, position: int) -> None:
        """Keep the request's state after `position` computed tokens (its state slot
        holds it until the next step's forward)."""
        if position < 1 or position > request.num_computed_tokens:
            return
        if not self.has_state:
            pool = self.block_pool
            if position % pool.block_size:  # full blocks are content-addressed already
                self._new_checkpoint(request, position, READY)
            return
        checkpoint = self._new_checkpoint(request, position, QUEUED)
        if checkpoint is not None:
            self._queued.append(PendingSave(request.state_slot, checkpoint))

    def _new_checkpoint(self, request, position: int, state: str) -> Checkpoint | None:
        """A checkpoint of request.all_token_ids[:position], or None when that prefix has
        one already or no state row can be had."""
        tokens = request.all_token_ids
        node = self.tree.find(tokens, position)
        if node is not None and node.value is not None:
            self._lru.move_to_end(node.value)
            return None
        row = None
        if self.has_state:
            row = self._take_row()
            if row is None:
                return None
        blocks: list[int] = []
        if self.block_pool is not None:
            blocks = request.block_ids[: self.block_pool.blocks_for(position)]
            self.block_pool.pin(blocks)
        node = self.tree.insert(tokens, position)
        checkpoint = Checkpoint(position, row, blocks, node, state)
        node.value = checkpoint
        self._lru[checkpoint] = None
        return checkpoint

    # -- eviction --------------------------------------------------------------------

    def _take_row(self) -> int | None:
        if not self._free_rows:
            victim = self._victim(lambda c: c.row is not None)
            if victim is None:
                return None
            self._evict(victim)
        return self._free_rows.pop()

    @staticmethod
    def _evictable(checkpoint: Checkpoint) -> bool:
        return checkpoint.users == 0 and checkpoint.state != WRITING

    def _victim(self, frees) -> Checkpoint | None:
        """The least recently used evictable checkpoint that `frees` what is needed."""
        for checkpoint in self._lru:
            if self._evictable(checkpoint) and frees(checkpoint):
                return checkpoint
        return None

    def _evict(self, checkpoint: Checkpoint) -> None:
        if checkpoint.state == QUEUED:
            self._queued = [p for p in self._queued if p.checkpoint is not checkpoint]
        del self._lru[checkpoint]
        self.tree.remove(checkpoint.node)
        if checkpoint.row is not None:
            self._free_rows.append(checkpoint.row)
        if checkpoint.block_ids:
            self.block_pool.unpin(checkpoint.block_ids)
