"""Mamba2ForCausalLM (Codestral Mamba and friends): Mamba2 blocks only, no KV cache."""

from __future__ import annotations

from torch import nn

from ssmserve.layers.mamba2_mixer import Mamba2Mixer
from ssmserve.models.base import ModelContext
from ssmserve.models.mamba import MambaStyleLM


class Mamba2ForCausalLM(MambaStyleLM):
    def make_mixer(self, cfg, ctx: ModelContext) -> nn.Module:
        return Mamba2Mixer(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            state_size=cfg.state_size,
            n_groups=cfg.n_groups,
            conv_kernel=cfg.conv_kernel,
            chunk_size=cfg.chunk_size,
            norm_eps=cfg.layer_norm_epsilon,
            ops=ctx.ops,
            tp=ctx.tp,
            activation=cfg.hidden_act,
            time_step_limit=tuple(cfg.time_step_limit),
            use_bias=cfg.use_bias,
            use_conv_bias=cfg.use_conv_bias,
        )
