"""Caches the engine owns, one per layer position, and the specs layers declare.

A model lists one `LayerCacheSpec` per decoder position (`CausalLM.cache_specs`): what
its attention needs (KV blocks) and what its SSM mixer needs (a conv + SSM state per
slot). The model runner allocates a `LayerCache` per position from the memory plan and
passes the list to each forward; the decoder hands position i its own cache. Nothing is
stored on modules, so a block whose weights serve several positions (a shared attention
block) gets one cache per use.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import torch


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
    conv: torch.Tensor  # [num_slots, conv_dim, d_conv - 1]
    ssm: torch.Tensor  # [num_slots, *ssm_shape]


@dataclass
class LayerCache:
    kv: KVCache | None = None
    state: SSMState | None = None


def cache_bytes(
    specs: list[LayerCacheSpec], block_size: int, dtype: torch.dtype, state_dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes of one KV block over every attention position and of one state slot over
    every SSM position."""
    per_block = sum(s.kv.bytes_per_block(block_size, dtype) for s in specs if s.kv)
    per_slot = sum(s.state.bytes_per_slot(dtype, state_dtype) for s in specs if s.state)
    return per_block, per_slot


def allocate_caches(
    specs: list[LayerCacheSpec],
    *,
    num_kv_blocks: int,
    block_size: int,
    num_state_slots: int,
    dtype: torch.dtype,
    state_dtype: torch.dtype,
    device: torch.device,
) -> list[LayerCache]:
    caches = []
    for spec in specs:
        cache = LayerCache()
        if spec.kv is not None:
            shape = (num_kv_blocks, block_size, spec.kv.num_kv_heads, spec.kv.head_dim)
            cache.kv = KVCache(
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
        if spec.state is not None:
            cache.state = SSMState(
                torch.zeros(num_state_slots, *spec.state.conv_shape, dtype=dtype, device=device),
                torch.zeros(
                    num_state_slots, *spec.state.ssm_shape, dtype=state_dtype, device=device
                ),
            )
        caches.append(cache)
    return caches
