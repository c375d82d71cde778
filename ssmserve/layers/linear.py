"""Tensor-parallel linears and sharded parameters, each with a `weight_loader`.

A parameter that is split over ranks keeps, as attributes, how it maps onto the
checkpoint tensor; its `weight_loader(param, checkpoint_tensor, shard_id)` copies this
rank's part. Output features are described by `Segment`s: a fused matrix (Mamba2's
in_proj, a merged gate/up, QKV) is a list of segments stacked along dim 0, each with
its own rule for which rows a rank holds (split evenly, by heads, by groups, or
replicated). `shard_id` names one segment when the checkpoint stores it as its own
tensor (q_proj, k_proj, ...); `shard_id=None` means the checkpoint tensor is the whole
fused matrix. At tensor_parallel_size 1 every layer here is a plain F.linear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssmserve.distributed.parallel import TensorParallel, require_divisible, shard_range


@dataclass(frozen=True)
class Segment:
    """`size` rows of the checkpoint tensor, of which this rank holds `rows`, in order."""

    size: int
    rows: range | tuple[int, ...]

    @classmethod
    def full(cls, size: int) -> Segment:
        return cls(size, range(size))

    @classmethod
    def even(cls, size: int, tp: TensorParallel) -> Segment:
        return cls(size, shard_range(size, tp.size, tp.rank))

    @classmethod
    def units(cls, units: Iterable[int], unit_size: int, num_units: int) -> Segment:
        """Rows of whole units (heads, groups) of `unit_size` rows each, in the given order."""
        units = list(units)
        if not units or units == list(range(units[0], units[0] + len(units))):
            start = units[0] * unit_size if units else 0
            return cls(num_units * unit_size, range(start, start + len(units) * unit_size))
        rows = tuple(u * unit_size + i for u in units for i in range(unit_size))
        return cls(num_units * unit_size, rows)


def _take_rows(t: torch.Tensor, rows: range | tuple[int, ...], dim: int = 0) -> torch.Tensor:
    if isinstance(rows, range) and rows.step == 1:
        return t.narrow(dim, rows.start, len(rows))
    return t.index_select(dim, torch.tensor(list(rows), dtype=torch.long, device=t.device))


def load_replicated(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """Default loader: the checkpoint tensor is the whole parameter."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shard {shard_id!r}")
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, {tuple(param.shape)}")
    param.data.copy_(loaded)


def load_row_segments(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
    """Copy this rank's rows of every segment (shard_id None) or of segment `shard_id`."""
    segments: Sequence[Segment] = param.segments
    if shard_id is None:
        total = sum(s.size for s in segments)
        if loaded.shape[0] != total:
            raise ValueError(f"{loaded.shape[0]} rows in the checkpoint, expected {total}")
        pieces = list(enumerate(loaded.split([s.size for s in segments], dim=0)))
    else:
        pieces = [(shard_id, loaded)]
    for index, full in pieces:
        seg = segments[index]
        if full.shape[0] != seg.size or tuple(full.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(
                f"segment {index} has shape {tuple(full.shape)} in the checkpoint, expected "
                f"({seg.size}, {', '.join(map(str, param.shape[1:]))})"
            )
        offset = sum(len(s.rows) for s in segments[:index])
        param.data[offset : offset + len(seg.rows)].copy_(_take_rows(full, seg.rows))


def load_columns(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """Copy this rank's input columns (dim 1) of a row-parallel weight."""
    if shard_id is not None:
        raise ValueError(f"a row-parallel weight has no shard {shard_id!r}")
    cols: Segment = param.columns
    if loaded.shape[0] != param.shape[0] or loaded.shape[1] != cols.size:
        raise ValueError(
            f"shape {tuple(loaded.shape)} in the checkpoint, expected "
            f"({param.shape[0]}, {cols.size})"
        )
    param.data.copy_(_take_rows(loaded, cols.rows, dim=1))


def replicated_parameter(*shape: int, fill: float = 0.0) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    param.weight_loader = load_replicated
    return param


def row_sharded_parameter(
    segments: Sequence[Segment], *trailing: int, fill: float = 0.0
) -> nn.Parameter:
    """A parameter whose dim 0 is `segments` stacked (this rank's rows of each)."""
    rows = sum(len(s.rows) for s in segments)
    param = nn.Parameter(torch.full((rows, *trailing), fill), requires_grad=False)
    param.segments = tuple(segments)
    param.shard_ids = tuple(range(len(segments)))
    param.weight_loader = load_row_segments
    return param


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemv: Callable[..., torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear, or for one row of x the module's `decode_gemv` where the model runner
    set one (decode with programmatic dependent launch, `get_ops(pdl=True)`: the GEMV in
    captured CUDA graphs, F.linear eagerly) and the weight's rows are contiguous, as the
    GEMV reads them. `out_dtype`: the result cast to it (the GEMV stores it so, with no
    launch of its own)."""
    if gemv is not None and x.dim() == 2 and x.shape[0] == 1 and weight.stride(1) == 1:
        if out_dtype is None:
            return gemv(x, weight, bias)
        return gemv(x, weight, bias, out_dtype=out_dtype)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with output features split over ranks by `segments`; no
    communication (each rank keeps its part of y)."""

    decode_gemv: Callable[..., torch.Tensor] | None = None

    def __init__(self, in_features: int, segments: Sequence[Segment], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.segments = tuple(segments)
        self.output_sizes = [len(s.rows) for s in self.segments]
        self.weight = row_sharded_parameter(self.segments, in_features)
        self.bias = row_sharded_parameter(self.segments) if bias else None

    @classmethod
    def even(
        cls, in_features: int, sizes: Sequence[int], tp: TensorParallel, bias: bool = False
    ) -> ColumnParallelLinear:
        """Each of `sizes` (stacked) split evenly over the ranks: a merged gate/up etc."""
        return cls(in_features, [Segment.even(n, tp) for n in sizes], bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.decode_gemv)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with input features split over ranks by `columns`; the partial
    products are summed over the ranks (all-reduce) and the bias is added once after.

    With `reduce_results=False` each rank returns its partial product (rank 0 adds the
    bias), for a caller that adds other partial sums before one all-reduce.
    """

    decode_gemv: Callable[..., torch.Tensor] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallel,
        bias: bool = False,
        columns: Segment | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce_results = reduce_results
        cols = columns or Segment.even(in_features, tp)
        self.weight = nn.Parameter(torch.zeros(out_features, len(cols.rows)), requires_grad=False)
        self.weight.columns = cols
        self.weight.weight_loader = load_columns
        self.bias = replicated_parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.decode_gemv
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, gemv)
        if not self.reduce_results:
            return linear(x, self.weight, self.bias if self.tp.rank == 0 else None, gemv)
        y = self.tp.all_reduce(linear(x, self.weight, None, gemv))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    """A linear every rank holds whole (small projections such as MoE routers)."""

    decode_gemv: Callable[..., torch.Tensor] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = replicated_parameter(out_features, in_features)
        self.bias = replicated_parameter(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.decode_gemv)


def head_segment(heads: Iterable[int], head_dim: int, num_heads: int) -> Segment:
    return Segment.units(heads, head_dim, num_heads)


def attention_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> tuple[range, range]:
    """Query heads and KV heads this rank holds. Query heads split evenly; KV heads split
    evenly when they divide by tp.size, else each rank holds the one KV head its query
    heads read (replicated), which needs tp.size to be a multiple of num_kv_heads."""
    require_divisible("num_attention_heads", num_heads, tp)
    q = shard_range(num_heads, tp.size, tp.rank)
    if num_kv_heads % tp.size == 0:
        return q, shard_range(num_kv_heads, tp.size, tp.rank)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads = {num_kv_heads} neither divides by nor divides "
            f"tensor_parallel_size = {tp.size}; use a size that {num_kv_heads} divides by or "
            f"a multiple of {num_kv_heads}"
        )
    kv = q.start * num_kv_heads // num_heads
    return q, range(kv, kv + 1)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused in one matrix (shards 0, 1, 2), by heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TensorParallel,
        bias: bool = False,
    ) -> None:
        q, kv = attention_heads(num_heads, num_kv_heads, tp)
        self.q_heads = q
        self.num_local_heads, self.num_local_kv_heads = len(q), len(kv)
        segments = [
            head_segment(q, head_dim, num_heads),
            head_segment(kv, head_dim, num_kv_heads),
            head_segment(kv, head_dim, num_kv_heads),
        ]
        super().__init__(hidden_size, segments, bias)


# Folding constant scales into loaded weights (a family's `fold_constants`): computed in
# float32 and rounded once to the weight's dtype.


@torch.no_grad()
def scale_output_rows(
    linear: nn.Module, scale: torch.Tensor | float, rows: slice = slice(None)
) -> None:
    """linear(x)[..., rows] * scale (a scalar or one value per row), folded into the
    weight (and bias) rows."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=linear.weight.device)
    w = linear.weight[rows]
    w.copy_(w.float() * scale.reshape(-1, 1))
    if linear.bias is not None:
        b = linear.bias[rows]
        b.copy_(b.float() * scale.reshape(-1))


@torch.no_grad()
def scale_input(linear: nn.Module, scale: float) -> None:
    """linear(x * scale), folded into the weight (the bias is not scaled)."""
    linear.weight.copy_(linear.weight.float() * scale)
