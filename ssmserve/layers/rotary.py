"""Rotary position embedding (neox layout: rotate halves), optionally on part of the head."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """The frequencies (`inv_freq`, from transformers' own RoPE init for the config) and
    scaling of a model's RoPE; attention applies them with the `rotary_embedding` op."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    @classmethod
    def from_hf_config(cls, hf_config) -> RotaryEmbedding:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            head_dim = getattr(hf_config, "head_dim", None) or (
                hf_config.hidden_size // hf_config.num_attention_heads
            )
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            base = params.get("rope_theta", 10000.0)
            steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
            inv_freq = 1.0 / (base ** (steps / dim))
            return cls(inv_freq)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        return cls(inv_freq, scaling)
