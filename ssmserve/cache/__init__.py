"""Pure-Python cache bookkeeping: KV block ids, SSM state slots, prefix caching, and the
memory split.

NOTE: nothing here imports torch; tests/test_boundaries.py asserts it.
"""

from ssmserve.cache.block_pool import BlockPool
from ssmserve.cache.planner import CachePlan, combine_plans, plan_cache
from ssmserve.cache.prefix_cache import PrefixCache, PrefixHit
from ssmserve.cache.state_pool import StatePool

__all__ = [
    "BlockPool",
    "StatePool",
    "CachePlan",
    "combine_plans",
    "plan_cache",
    "PrefixCache",
    "PrefixHit",
]
