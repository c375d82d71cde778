"""LlamaForCausalLM: the pure-attention baseline we compare speed against."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.kernels import KernelOps
from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.mlp import GatedMLP
from ssmserve.layers.norm import RMSNorm
from ssmserve.layers.rotary import RotaryEmbedding
from ssmserve.models.base import CausalLM


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, ops: KernelOps, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ops, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            bias=getattr(cfg, "mlp_bias", False),
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(CausalLM):
    def __init__(self, hf_config, ops: KernelOps) -> None:
        super().__init__(hf_config)
        rotary = RotaryEmbedding.from_hf_config(hf_config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.model.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, ops, rotary) for _ in range(hf_config.num_hidden_layers)
        )
        self.model.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return self.model.norm
