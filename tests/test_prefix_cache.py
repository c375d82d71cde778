"""Prefix caching's bookkeeping as pure Python: radix tree, content-addressed KV blocks,
and the scheduler with a prefix cache driving a symbolic model.

The symbolic model stands in for the real one: a state row (slot or checkpoint) holds the
tokens whose effect it carries, a KV entry the prefix its K/V were computed from. Each
forward checks that what a chunk reads (its slot's state, the KV of every earlier
position) is exactly its own prefix, so a restore from the wrong or an unfinished
checkpoint, a block shared or freed while in use, or a copy in the wrong order fails.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssmserve.cache import BlockPool, PrefixCache, StatePool, plan_cache
from ssmserve.cache.prefix_cache import QUEUED, READY
from ssmserve.cache.radix_tree import RadixTree, common_prefix_length
from ssmserve.scheduler import Request, RequestStatus, Scheduler, StepPlan

# -- radix tree ------------------------------------------------------------------------


def tree_prefix(node) -> list[int]:
    edges = []
    while node.parent is not None:
        edges.append(node.edge)
        node = node.parent
    return [t for edge in reversed(edges) for t in edge]


def check_tree_shape(tree: RadixTree) -> None:
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.edge and child.edge[0] == first
            assert child.depth == node.depth + len(child.edge)
            stack.append(child)
        if node is not tree.root and node.value is None:
            assert len(node.children) >= 2, "a branch point without a value has one child"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    st.lists(st.integers(0, 2), max_size=14),
)
def test_radix_tree_matches_a_set_of_prefixes(ops, query):
    """Inserts and removals against a plain dict of stored prefixes."""
    tree, stored = RadixTree(), {}
    for tokens, remove in ops:
        key = tuple(tokens)
        if remove and key in stored:
            tree.remove(stored.pop(key))
        elif not remove:
            node = tree.insert(tokens, len(tokens))
            assert tree_prefix(node) == tokens and tree.find(tokens, len(tokens)) is node
            node.value = key
            stored[key] = node
        check_tree_shape(tree)
    for limit in range(len(query) + 1):
        fits = [k for k in stored if len(k) <= limit and tuple(query[: len(k)]) == k]
        expected = max(fits, key=len, default=None)
        assert tree.deepest(query, limit, lambda v: True) == expected
    for key, node in stored.items():
        assert tree.find(list(key), len(key)) is node and node.value == key


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    long = list(range(1000))
    assert common_prefix_length(long, long[:700] + [-1]) == 700
    # Against a token-by-token walk, across the 64-token runs the search compares.
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(2) for _ in range(rng.choice([1, 63, 64, 65, 129, 700]))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(2) for _ in range(rng.randrange(70))]
        walk = 0
        while walk < min(len(a), len(b)) and a[walk] == b[walk]:
            walk += 1
        assert common_prefix_length(a, b) == walk


# -- content-addressed blocks ------------------------------------------------------------


def test_full_blocks_are_found_by_content_and_stored_once():
    pool = BlockPool(8, 4, enable_caching=True)
    tokens = list(range(10))
    a = pool.allocate(3)
    pool.commit(a, tokens, 0, 2)  # two full blocks
    b = pool.allocate(3)
    pool.commit(b, tokens, 0, 2)
    assert b[:2] == a[:2], "the second copy of a full block is replaced by the first"
    assert pool.num_used == 4 and pool.num_free == 4
    assert pool.cached_prefix(tokens) == a[:2]
    assert pool.cached_prefix([0, 1, 2, 3, 9, 9, 9, 9]) == a[:1]
    assert pool.cached_prefix([9] + tokens[1:]) == [], "a block is keyed by its prefix too"
    pool.free(a)
    pool.free(b)
    assert pool.num_used == 0 and pool.num_cached == 2
    assert pool.cached_prefix(tokens) == a[:2], "freed blocks keep their content"
    # The free list first, then cached blocks: the later block of the prefix first.
    taken = pool.allocate(7)
    assert taken[-1] == a[1] and pool.cached_prefix(tokens) == a[:1]
    assert pool.allocate(2) is None


def test_pinned_blocks_are_never_handed_out():
    pool = BlockPool(3, 2, enable_caching=True)
    blocks = pool.allocate(2)
    pool.commit(blocks, [1, 2, 3, 4], 0, 2)
    pool.pin(blocks)
    pool.free(blocks)
    assert pool.num_used == 0 and pool.num_free == 1
    assert pool.allocate(2) is None
    pool.unpin(blocks)
    assert sorted(pool.allocate(3)) == [0, 1, 2]


# -- the scheduler with a prefix cache, against a symbolic model ---------------------------


class SymbolicModel:
    """What each state row and KV entry holds: the token prefix it was computed from."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.rows: dict[int, tuple] = {}
        self.kv: dict[int, list] = {}
        self.reads = 0

    def run(self, plan, has_state: bool, has_kv: bool, pending=None) -> dict[str, int]:
        """`pending`: request id -> the token the step in flight samples for it (a step
        launched before the one before it was applied reads it on the device)."""
        ops = plan.cache_ops
        saved = {dst: self.rows.get(src) for src, dst in ops.state_saves}
        self.rows.update(saved)
        restored = {dst: self.rows.get(src) for src, dst in ops.state_restores}
        self.rows.update(restored)
        for src, dst in ops.block_copies:
            self.kv[dst] = list(self.kv.get(src, [None] * self.block_size))
        sampled = {}
        bs = self.block_size
        for chunk in plan.chunks:
            r = chunk.request
            tokens = tuple(r.all_token_ids)
            if chunk.end > len(tokens):
                tokens += (pending[r.request_id],)
            if has_state and chunk.start > 0:
                assert self.rows.get(r.state_slot) == tokens[: chunk.start], (r, "state")
                self.reads += 1
            if has_kv:
                for p in range(chunk.start):
                    block = self.kv.get(r.block_ids[p // bs], [None] * bs)
                    assert block[p % bs] == tokens[: p + 1], (r, "kv at", p)
                for p in range(chunk.start, chunk.end):
                    entries = self.kv.setdefault(r.block_ids[p // bs], [None] * bs)
                    entries[p % bs] = tokens[: p + 1]
            if has_state:
                for k, row in chunk.snapshots:
                    self.rows[row] = tokens[: chunk.start + k]
                self.rows[r.state_slot] = tokens[: chunk.end]
            if chunk.samples:
                sampled[r.request_id] = hash(tokens[: chunk.end]) % 50
        return sampled


def check_checkpoints(cache: PrefixCache, model: SymbolicModel, has_kv: bool) -> None:
    """Between steps every READY checkpoint holds its prefix, and its pins keep it."""
    bs = model.block_size
    queued = {id(p.checkpoint): p.slot for p in cache._queued}
    for checkpoint in cache._lru:
        prefix = tuple(tree_prefix(checkpoint.node))
        assert len(prefix) == checkpoint.position
        if checkpoint.row is not None:
            if checkpoint.state == READY:
                assert model.rows.get(checkpoint.row) == prefix, "a ready checkpoint is wrong"
            elif checkpoint.state == QUEUED:
                assert model.rows.get(queued[id(checkpoint)]) == prefix
        if has_kv:
            for p in range(checkpoint.position):
                entries = model.kv.get(checkpoint.block_ids[p // bs], [None] * bs)
                assert entries[p % bs] == prefix[: p + 1], "a pinned block was overwritten"


def prompt_tree(rng: random.Random, num: int, max_len: int) -> list[list[int]]:
    """Prompts that share prefixes of random lengths with earlier ones."""
    prompts: list[list[int]] = []
    for _ in range(num):
        if prompts and rng.random() < 0.75:
            parent = rng.choice(prompts)
            shared = parent[: rng.randint(1, len(parent))]
        else:
            shared = []
        tail = [rng.randrange(1, 40) for _ in range(rng.randint(0 if shared else 1, max_len))]
        prompts.append((shared + tail)[:max_len] or [1])
    return prompts


def make_scheduler(kind, budget, num_blocks, block_size, slots, checkpoints, interval):
    has_kv, has_state = kind in ("hybrid", "attention"), kind in ("hybrid", "ssm")
    pool = BlockPool(num_blocks, block_size, enable_caching=True) if has_kv else None
    cache = PrefixCache(
        block_pool=pool,
        has_state=has_state,
        num_slots=slots,
        num_checkpoints=checkpoints,
        interval=interval,
    )
    scheduler = Scheduler(
        max_num_seqs=slots,
        max_num_batched_tokens=budget,
        max_tokens_per_request=num_blocks * block_size if has_kv else 10**6,
        block_pool=pool,
        state_pool=StatePool(slots) if has_state else None,
        prefix_cache=cache,
    )
    return scheduler, cache, SymbolicModel(block_size), has_state, has_kv


def launch(scheduler, model, plan, has_state, has_kv, pending=None):
    """What the engine does with a plan it is about to run: drop the chunks whose request
    finished since planning, queue the saves, run the (symbolic) forward."""
    dropped = [c for c in plan.chunks if not c.is_current]
    if dropped:
        scheduler.discard(plan, dropped)
        plan.chunks = [c for c in plan.chunks if c.is_current]
    if not plan.chunks:
        return None
    scheduler.before_launch(plan)
    sampled = model.run(plan, has_state, has_kv, pending)
    scheduler.after_launch(plan)
    return plan, sampled


def drive(
    scheduler,
    cache,
    model,
    has_state,
    has_kv,
    arrivals,
    aborts=(),
    max_steps=3000,
    order="launch_ahead",
):
    """Run `arrivals` ([(step, Request)]) to the end, aborting the oldest live request at
    the steps in `aborts`; returns the finished requests by id. The engine's orders:
    "launch_ahead" plans and launches step n+1, then applies step n's tokens (one
    device); "plan_ahead" plans n+1, applies n's tokens, then launches n+1 (tensor
    parallel); "sync" runs each step start to finish."""
    pending = sorted(arrivals, key=lambda a: a[0])
    done, step, in_flight = {}, 0, None

    def apply(in_flight):
        for r in scheduler.update(*in_flight):
            if r.is_finished:
                done[r.request_id] = r

    while pending or scheduler.has_unfinished_requests() or in_flight:
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1])
        plan = scheduler.schedule()
        if order == "launch_ahead" and in_flight is not None and plan.chunks:
            ahead = launch(scheduler, model, plan, has_state, has_kv, pending=in_flight[1])
            apply(in_flight)
            in_flight, plan = ahead, None
        if order == "sync" and plan.chunks:
            in_flight = launch(scheduler, model, plan, has_state, has_kv)
            plan = None
        if in_flight is not None:
            apply(in_flight)
            in_flight = None
        if plan is not None and plan.chunks:
            in_flight = launch(scheduler, model, plan, has_state, has_kv)
        if step in aborts and scheduler.requests:
            scheduler.abort_request(min(scheduler.requests))
        check_checkpoints(cache, model, has_kv)
        step += 1
        assert step < max_steps, "no progress"
    return done


def assert_all_released(scheduler, cache) -> None:
    assert scheduler.state_pool is None or scheduler.state_pool.num_used == 0
    pool = scheduler.block_pool
    assert pool is None or pool.num_used == 0
    assert cache.all_evictable(), "a checkpoint is locked after all requests ended"
    assert cache.clear() == 0 and cache.num_rows_used == 0
    assert pool is None or pool.num_free == pool.num_blocks


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["hybrid", "ssm", "attention"]),
    seed=st.integers(0, 10**6),
    budget=st.integers(1, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    slots=st.integers(1, 4),
    checkpoints=st.integers(0, 6),
    interval=st.sampled_from([1, 3, 4, 16]),
    spare_blocks=st.integers(0, 12),
    aborts=st.sets(st.integers(0, 60), max_size=3),
    order=st.sampled_from(["launch_ahead", "plan_ahead", "sync"]),
)
def test_every_read_is_of_the_right_prefix(
    kind, seed, budget, block_size, slots, checkpoints, interval, spare_blocks, aborts, order
):
    """Random prompt trees, budgets down to one token, preemption (few KV blocks),
    aborts, tiny checkpoint pools, steps planned while the one before runs or not: every
    restored state and KV entry is the request's own prefix, outputs equal an uncached
    run's, and everything is released at the end."""
    rng = random.Random(seed)
    prompts = prompt_tree(rng, rng.randint(1, 10), 30)
    max_tokens = rng.randint(1, 6)
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = -(-longest // block_size) + spare_blocks
    arrivals = [
        (rng.randint(0, 40), Request(f"r{i}", p, max_tokens=max_tokens))
        for i, p in enumerate(prompts)
    ]
    parts = make_scheduler(kind, budget, num_blocks, block_size, slots, checkpoints, interval)
    done = drive(*parts, arrivals, aborts, order=order)
    scheduler, cache = parts[:2]
    # The symbolic model's tokens are a function of the prefix: equal for any caching.
    for _, r in arrivals:
        if r.status == RequestStatus.FINISHED_ABORTED:
            continue
        assert r.request_id in done and len(r.output_token_ids) == max_tokens
        tokens = list(r.prompt_token_ids)
        for out in r.output_token_ids:
            assert out == hash(tuple(tokens)) % 50
            tokens.append(out)
    assert_all_released(scheduler, cache)


def run_one(parts, prompt, max_tokens=3, name="q"):
    r = Request(name, prompt, max_tokens=max_tokens)
    drive(*parts, [(0, r)])
    return r


@pytest.mark.parametrize("kind", ["hybrid", "ssm", "attention"])
@pytest.mark.parametrize("length", [2, 3, 7, 16, 17, 40])
def test_a_repeated_prompt_hits_all_but_its_last_token(kind, length):
    parts = make_scheduler(kind, 8, 64, 4, 2, 8, 16)
    prompt = list(range(1, length + 1))
    first = run_one(parts, prompt, name="first")
    again = run_one(parts, prompt, name="again")
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == length - 1
    assert again.output_token_ids == first.output_token_ids


@pytest.mark.parametrize("kind", ["hybrid", "ssm", "attention"])
@pytest.mark.parametrize("shared", [1, 15, 16, 17, 33, 47])
def test_prompts_sharing_a_prefix_hit_it_to_a_checkpoint(kind, shared):
    """At least the shared tokens rounded down to the interval (SSM layers) or the block
    (attention only)."""
    interval, block = 16, 4
    parts = make_scheduler(kind, 64, 64, block, 2, 8, interval)
    base = list(range(1, 60))
    run_one(parts, base, name="first")
    other = base[:shared] + [99] * 5
    second = run_one(parts, other, name="second")
    step = interval if kind != "attention" else block
    assert second.num_cached_tokens >= shared // step * step


@pytest.mark.parametrize("kind", ["hybrid", "ssm", "attention"])
def test_a_follow_up_turn_hits_the_earlier_turn(kind):
    parts = make_scheduler(kind, 16, 64, 4, 2, 8, 16)
    prompt = list(range(1, 22))
    first = run_one(parts, prompt, max_tokens=5, name="turn1")
    turn2 = prompt + first.output_token_ids + [7, 8, 9]
    second = run_one(parts, turn2, name="turn2")
    assert second.num_cached_tokens >= len(prompt) + 5 - 1


def test_samples_of_one_prompt_compute_it_once():
    """Requests on a prefix another running request is prefilling wait for its
    checkpoints instead of computing the same tokens again."""
    parts = make_scheduler("hybrid", 200, 64, 4, 4, 8, 16)
    prompt = list(range(1, 81))
    samples = [(0, Request(f"s{i}", prompt, max_tokens=3)) for i in range(3)]
    drive(*parts, samples)
    assert [r.num_cached_tokens for _, r in samples] == [0, 79, 79]
    short = [(0, Request(f"t{i}", list(range(100, 130)), max_tokens=3)) for i in range(2)]
    drive(*parts, short)
    assert [r.num_cached_tokens for _, r in short] == [0, 0], "not worth a step's wait"


def test_a_shared_prefix_is_stored_once():
    """Requests running at the same time on one 32-token prefix hold the same blocks."""
    parts = make_scheduler("attention", 200, 64, 4, 4, 0, 16)
    scheduler, cache, model = parts[:3]
    prefix = list(range(1, 33))
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", prefix + [100 + i] * 3, max_tokens=20))
    for _ in range(3):
        plan = scheduler.schedule()
        scheduler.update(plan, model.run(plan, False, True))
    tables = [r.block_ids[:8] for r in scheduler.running]
    assert len(tables) == 4 and all(t == tables[0] for t in tables)


def test_eviction_takes_the_least_recently_used_first():
    """Made or hit, the least recent goes first, a parent before its child included; the
    child still serves on its own."""
    cache = PrefixCache(
        block_pool=None, has_state=True, num_slots=1, num_checkpoints=3, interval=99
    )

    def keep(tokens):
        r = Request("r", tokens + [0], max_tokens=1)
        r.state_slot, r.num_computed_tokens = 0, len(tokens)
        cache.save(r, len(tokens))
        plan = StepPlan()
        cache.plan_step(plan)  # the save runs in a step
        cache.step_done(plan)

    def kept():
        return sorted(tuple(tree_prefix(c.node)) for c in cache._lru)

    a, b, c = [1, 2, 3], [1, 2, 3, 4, 5], [7, 7]
    for tokens in (a, b, c):
        keep(tokens)
    hit = cache.lookup(a + [9])
    assert hit.position == 3
    cache.hold(hit)
    plan = StepPlan()
    cache.use(hit, [], 0, plan)
    cache.step_done(plan)  # a is the most recently used now: b, then c go first
    keep([8])
    assert kept() == sorted([tuple(a), tuple(c), (8,)])
    keep([9])
    assert kept() == sorted([tuple(a), (8,), (9,)])
    keep(b)  # evicts a, b's parent
    assert kept() == sorted([(8,), (9,), tuple(b)])
    assert cache.lookup(b + [6]).position == 5, "a child outlives its evicted parent"
    assert cache.lookup(a + [9]) is None


def test_planner_gives_checkpoints_their_share():
    common = dict(bytes_per_slot=1_000, block_size=16, max_num_seqs=4, max_model_len=320)
    hybrid = plan_cache(
        budget_bytes=100_000, bytes_per_block=100, checkpoint_fraction=0.25, **common
    )
    assert hybrid.num_state_checkpoints == 25 and hybrid.num_state_slots == 4
    assert hybrid.num_kv_blocks == (100_000 - 29 * 1_000) // 100
    pure = plan_cache(budget_bytes=100_000, bytes_per_block=0, checkpoint_fraction=0.25, **common)
    assert pure.num_state_checkpoints == 96, "without attention they take what slots leave"
    fixed = plan_cache(budget_bytes=100_000, bytes_per_block=100, num_checkpoints=3, **common)
    assert fixed.num_state_checkpoints == 3
    off = plan_cache(budget_bytes=100_000, bytes_per_block=100, **common)
    assert off.num_state_checkpoints == 0 and off.num_kv_blocks == (100_000 - 4_000) // 100
    with pytest.raises(ValueError, match="no room for KV blocks"):
        plan_cache(budget_bytes=100_000, bytes_per_block=100, num_checkpoints=96, **common)


def test_a_checkpoint_a_step_uses_is_never_evicted():
    """A queued save that an admitted request restores from stays, even when the only
    state row another snapshot could get is its own."""
    pool = BlockPool(8, 2, enable_caching=True)
    cache = PrefixCache(
        block_pool=pool, has_state=True, num_slots=2, num_checkpoints=1, interval=16
    )
    done = Request("done", [1, 2, 3, 4, 5, 6], max_tokens=1)
    done.block_ids, done.state_slot, done.num_computed_tokens = pool.allocate(3), 0, 5
    cache.save(done, 5)
    pool.free(done.block_ids)
    hit = cache.lookup([1, 2, 3, 4, 5, 6, 7])
    assert hit is not None and hit.position == 5 and hit.checkpoint.state == QUEUED
    cache.hold(hit)
    other = Request("other", [9, 9, 9, 9], max_tokens=1)
    other.block_ids, other.state_slot, other.num_computed_tokens = pool.allocate(2), 1, 3
    cache.save(other, 3)
    assert [p.checkpoint for p in cache._queued] == [hit.checkpoint], "the held one stays"
    cache.unhold(hit)
    cache.save(other, 3)
    assert [p.checkpoint.position for p in cache._queued] == [3]
