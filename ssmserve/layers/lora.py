"""Low-rank adapters whose output is added to a tensor-parallel projection's output.

delta(x) = B (A x). A [rank, in] is replicated: every rank reads the whole input, as the
column-parallel projection the delta is added to does. B [out, rank] is split by that
projection's own output segments, so each rank computes exactly its slice of the whole
delta, with no communication, at any tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ssmserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, Segment


class LoRA(nn.Sequential):
    """`0` is A (in -> rank), `1` is B (rank -> the rows `segments` give this rank): the
    layout of an `nn.Sequential(Linear(in, rank), Linear(rank, out))` in a checkpoint."""

    def __init__(self, in_features: int, rank: int, segments: Sequence[Segment]) -> None:
        super().__init__(ReplicatedLinear(in_features, rank), ColumnParallelLinear(rank, segments))
