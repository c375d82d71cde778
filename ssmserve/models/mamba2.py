"""Mamba2ForCausalLM (Codestral Mamba and friends): Mamba2 blocks only, no KV cache."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.mamba2_mixer import Mamba2Mixer
from ssmserve.layers.norm import RMSNorm
from ssmserve.models.base import CausalLM


class Mamba2Block(nn.Module):
    def __init__(self, cfg, ops: KernelOps) -> None:
        super().__init__()
        self.residual_in_fp32 = getattr(cfg, "residual_in_fp32", True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            state_size=cfg.state_size,
            n_groups=cfg.n_groups,
            conv_kernel=cfg.conv_kernel,
            chunk_size=cfg.chunk_size,
            norm_eps=cfg.layer_norm_epsilon,
            ops=ops,
            time_step_limit=tuple(cfg.time_step_limit),
            use_bias=cfg.use_bias,
            use_conv_bias=cfg.use_conv_bias,
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        dtype = self.norm.weight.dtype
        res = hidden.float() if self.residual_in_fp32 else hidden
        out = self.mixer(self.norm(hidden.to(dtype)), batch)
        return res + out


class Mamba2ForCausalLM(CausalLM):
    def __init__(self, hf_config, ops: KernelOps) -> None:
        super().__init__(hf_config)
        self.backbone = nn.Module()
        self.backbone.embeddings = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.backbone.layers = nn.ModuleList(
            Mamba2Block(hf_config, ops) for _ in range(hf_config.num_hidden_layers)
        )
        self.backbone.norm_f = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)
        self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)

    def input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def final_norm(self) -> nn.Module:
        return self.backbone.norm_f

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return super().forward(batch).to(self.lm_head.weight.dtype)
