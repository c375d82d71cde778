"""Caches the engine owns, one per layer position, and the specs layers declare.

A model lists one `LayerCacheSpec` per decoder position (`CausalLM.cache_specs`): what
its attention needs (KV blocks) and what its SSM mixer needs (a conv + SSM state per
slot). The model runner allocates a `LayerCache` per position from the memory plan and
passes the list to each forward; the decoder hands position i its own cache. Nothing is
stored on modules, so a block whose weights serve several positions (a shared attention
block) gets one cache per use.

State tensors have a row per state slot and, after them, a row per prefix-caching
checkpoint: saving and restoring a state is a row copy within each tensor
(`apply_cache_copies`), on every rank for its own shard. The tensors of one kind and
shape are views into one stack, [positions, rows, ...] (each position's view contiguous,
as if allocated alone), so a step's copies are two kernels per stack, not per layer.

How decode steps round the new SSM state into a 16-bit pool belongs to the pool too:
`SSMState.rounding_seed` is None (to nearest) or the key of the position's stochastic
rounding noise (`mamba_ssm_stochastic_rounding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from ssmserve.layers.batch import CacheCopies, ForwardBatch


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheSpec:
    num_kv_heads: int  # on this rank
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * _elem(dtype)


@dataclass(frozen=True)
class StateSpec:
    conv_shape: tuple[int, ...]  # per slot, model dtype: [conv_dim, d_conv - 1]
    ssm_shape: tuple[int, ...]  # per slot, state dtype
    # Absolute positions inside a prefill chunk where the scan can write its state must
    # be multiples of this (the SSD kernels' chunk); None: any position.
    snapshot_multiple: int | None = None

    def bytes_per_slot(self, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        return prod(self.conv_shape) * _elem(dtype) + prod(self.ssm_shape) * _elem(state_dtype)


@dataclass(frozen=True)
class LayerCacheSpec:
    kv: KVCacheSpec | None = None
    state: StateSpec | None = None


class KVCache(NamedTuple):
    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor


class SSMState(NamedTuple):
    conv: torch.Tensor  # [num_rows, conv_dim, d_conv - 1]: state slots, then checkpoints
    ssm: torch.Tensor  # [num_rows, *ssm_shape]
    # Decode writes into a 16-bit `ssm` round stochastically with this 32-bit key (one
    # per layer position and rank); None: to nearest.
    rounding_seed: int | None = None


@dataclass
class LayerCache:
    kv: KVCache | None = None
    state: SSMState | None = None


class Caches(NamedTuple):
    """What `allocate_caches` makes: a cache per position, and the stacks their tensors
    are views into, by kind ("state": conv and SSM states; "kv": K and V blocks)."""

    layers: list[LayerCache]
    stacks: list[tuple[str, torch.Tensor]]


def cache_bytes(
    specs: list[LayerCacheSpec], block_size: int, dtype: torch.dtype, state_dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes of one KV block over every attention position and of one state slot over
    every SSM position."""
    per_block = sum(s.kv.bytes_per_block(block_size, dtype) for s in specs if s.kv)
    per_slot = sum(s.state.bytes_per_slot(dtype, state_dtype) for s in specs if s.state)
    return per_block, per_slot


# Each position's view starts at a multiple of this many bytes, as its own allocation
# would (kernels that assume aligned pointers keep working).
_VIEW_ALIGN = 256


def _stack(n: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros [n, *shape] whose n views [i] are contiguous and _VIEW_ALIGN-aligned."""
    per = _VIEW_ALIGN // _elem(dtype)
    pitch = -(-prod(shape) // per) * per
    flat = torch.zeros(n * pitch, dtype=dtype, device=device)
    return flat.as_strided((n, *shape), (pitch, *torch.empty(shape, device="meta").stride()))


def allocate_caches(
    specs: list[LayerCacheSpec],
    *,
    num_kv_blocks: int,
    block_size: int,
    num_state_slots: int,  # state rows: slots plus checkpoints
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    device: torch.device,
    rounding_seeds: list[int | None] | None = None,
) -> Caches:
    """One cache per position of `specs`; `rounding_seeds` (one per position, None
    entries or None in all: round to nearest) is each SSM position's `rounding_seed`."""
    # Per stack: its kind, (rows, *shape, dtype) and the tensors' places (position, field).
    groups: dict[tuple[str, tuple[int, ...], torch.dtype], list[tuple[int, str]]] = {}
    for i, spec in enumerate(specs):
        if spec.kv is not None:
            shape = (num_kv_blocks, block_size, spec.kv.num_kv_heads, spec.kv.head_dim)
            groups.setdefault(("kv", shape, dtype), []).extend([(i, "k"), (i, "v")])
        if spec.state is not None:
            conv = (num_state_slots, *spec.state.conv_shape)
            ssm = (num_state_slots, *spec.state.ssm_shape)
            groups.setdefault(("state", conv, dtype), []).append((i, "conv"))
            groups.setdefault(("state", ssm, state_dtype), []).append((i, "ssm"))
    views: dict[tuple[int, str], torch.Tensor] = {}
    stacks = []
    for (kind, shape, dt), places in groups.items():
        stack = _stack(len(places), shape, dt, device)
        stacks.append((kind, stack))
        views.update(zip(places, stack.unbind(0), strict=True))
    layers = []
    for i, spec in enumerate(specs):
        cache = LayerCache()
        if spec.kv is not None:
            cache.kv = KVCache(views[i, "k"], views[i, "v"])
        if spec.state is not None:
            seed = rounding_seeds[i] if rounding_seeds is not None else None
            cache.state = SSMState(views[i, "conv"], views[i, "ssm"], seed)
        layers.append(cache)
    return Caches(layers, stacks)


def apply_cache_copies(stacks: list[tuple[str, torch.Tensor]], copies: CacheCopies) -> None:
    """Make a step's cache copies in every layer (`stacks` from `allocate_caches`): state
    saves, then state restores (a step may restore what it saves), then KV block copies."""
    moves = (
        (copies.save_slots, copies.save_rows, "state"),
        (copies.restore_rows, copies.restore_slots, "state"),
        (copies.block_sources, copies.block_destinations, "kv"),
    )
    for sources, destinations, kind in moves:
        if sources.numel() == 0:
            continue
        for stack_kind, stack in stacks:
            if stack_kind == kind:
                stack.index_copy_(1, destinations, stack.index_select(1, sources))


class ConvSnapshotSources(NamedTuple):
    """Where each conv-state snapshot of a step comes from, for one conv width: the same
    for every SSM layer of the step, so it is made once (`ForwardBatch.conv_snapshots`)
    and each layer's `snapshot_conv_states` is a gather and a scatter, plus four
    kernels only where a snapshot reaches back into its slot's state."""

    rows: torch.Tensor  # [M] checkpoint rows written
    token_index: torch.Tensor  # [M * (K-1)] input row of each state column (clamped to 0)
    # None when every column comes from the step's inputs; else (from_input [M, 1, K-1]
    # bool, slot [M] read, column [M, 1, K-1] of the slot's state, has_state [M, 1, 1]).
    from_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None


def conv_snapshot_sources(
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    snapshots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    width: int,
    reaches_state: bool = True,
) -> ConvSnapshotSources:
    """The sources of the conv states at chunk boundaries inside prefill sequences.

    The conv state after k tokens of sequence s is its last K-1 inputs: rows
    x[start_s + k - K + 1 : start_s + k], reaching back into the slot's state (zeros
    without one) where k < K - 1. cu_seqlens, state_slots, has_initial_state: the
    prefill sequences'; snapshots: (sequence index, k, row), each [M]; width: K - 1.
    `reaches_state=False` promises every k >= K - 1 (known on the host), which leaves
    the slot's state out. Device ops only (no host sync).
    """
    seqs, lens, rows = snapshots
    start = cu_seqlens.long()[seqs]  # [M]
    t = (start + lens - width)[:, None] + torch.arange(width, device=start.device)  # [M, K-1]
    from_state = None
    if reaches_state:
        from_input = (t >= start[:, None])[:, None, :]
        column = (width + t - start[:, None]).clamp(0, width - 1)[:, None, :]
        has_state = has_initial_state[seqs][:, None, None]
        from_state = (from_input, state_slots[seqs], column, has_state)
    return ConvSnapshotSources(rows, t.clamp(min=0).flatten(), from_state)


def snapshot_conv_states(
    x: torch.Tensor, conv_state: torch.Tensor, sources: ConvSnapshotSources
) -> None:
    """Write the conv state at chunk boundaries inside prefill sequences into checkpoint
    rows, before the varlen conv overwrites the slots' states. x: [T, Cd] the conv inputs
    of the prefill sequences; conv_state: [rows, Cd, K-1]; sources: see
    `conv_snapshot_sources`. Device ops only (no host sync)."""
    num, width = sources.rows.shape[0], conv_state.shape[2]
    values = x[sources.token_index].view(num, width, x.shape[1]).transpose(1, 2)  # [M, Cd, K-1]
    if sources.from_state is not None:
        from_input, slots, column, has_state = sources.from_state
        # Read before anything writes: checkpoint rows are not slots.
        earlier = conv_state[slots].gather(2, column.expand(-1, conv_state.shape[1], -1))
        values = torch.where(from_input, values.to(conv_state.dtype), earlier * has_state)
    conv_state[sources.rows] = values.to(conv_state.dtype)


def decode_rounding(batch: ForwardBatch, state: SSMState) -> dict[str, Any]:
    """The state update's rounding keyword arguments for the batch's decode rows: with
    stochastic rounding, each row's noise counter is its token's position, read from the
    batch on the device (NOTE: so a replayed CUDA graph draws new noise every step)."""
    if state.rounding_seed is None:
        return {}
    return {
        "rounding_offsets": batch.positions[: batch.num_decodes],
        "rounding_seed": state.rounding_seed,
    }


def scan_snapshot_args(
    snapshots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """The SSM scans' snapshot keyword arguments for a batch's `snapshots_p`."""
    if snapshots is None:
        return {}
    names = ("snapshot_seqs", "snapshot_lens", "snapshot_slots")
    return dict(zip(names, snapshots, strict=True))
