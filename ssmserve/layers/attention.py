"""Attention over the paged KV cache (RoPE, GQA/MQA)."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """q/k/v/o projections named as in HF checkpoints; K/V live in paged blocks.

    Each step writes the new tokens' K/V into the cache first, then every query attends
    over its sequence's cached context plus itself: one op for prefill with or without
    cached context and for decode.
    """

    def __init__(self, hf_config, ops: KernelOps, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // self.num_heads
        )
        bias = getattr(hf_config, "attention_bias", False)
        hidden = hf_config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        self.ops = ops
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def cache_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(batch.positions, q, k)
        self.ops.write_kv_cache(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
        out = self.ops.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            block_tables=batch.block_tables,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=self.scale,
            num_decodes=batch.num_decodes,
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
