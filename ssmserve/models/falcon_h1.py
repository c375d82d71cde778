"""FalconH1ForCausalLM: in every layer attention (RoPE) and a Mamba2 mixer read the same
normalised input side by side and both outputs join the residual; a SwiGLU MLP follows.

µP multipliers: the embeddings, the SSM input and output, in_proj's five segments
(`ssm_multipliers`, for z, x, B, C, dt), the attention input and output, the keys, the
MLP's gate and output, and the logits. Those on a linear map's input or output are folded
into its weights once they are loaded (`fold_constants`; float32 gives transformers'
results to rounding), so a decode step runs no elementwise multiply for them; the keys'
goes into the softmax scale, the embeddings' and the logits' stay (one multiply a step). The
Mamba2 mixer has its own width (`mamba_d_ssm`) and its gated RMSNorm is optional
(`mamba_rms_norm`, grouped by `mamba_n_groups`, `mamba_norm_before_gate`).
"""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import KernelOps
from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.linear import scale_input, scale_output_rows
from ssmserve.layers.mamba2_mixer import Mamba2Mixer
from ssmserve.layers.mlp import GatedMLP
from ssmserve.layers.norm import RMSNorm
from ssmserve.layers.rotary import RotaryEmbedding
from ssmserve.models.base import (
    GATE_UP_RULES,
    QKV_RULES,
    CausalLM,
    ModelContext,
    PreNormBlock,
    bamba_style_mamba2,
    scaled,
)


class ScaledEmbedding(VocabParallelEmbedding):
    """Embedding rows times `embedding_multiplier` (the weight stays as in the checkpoint,
    so a tied LM head reads it unscaled)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, multiplier: float):
        super().__init__(vocab_size, hidden_size, tp)
        self.multiplier = float(multiplier)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return scaled(super().forward(ids), self.multiplier)


class FalconH1MLP(GatedMLP):
    """down(up(x) * act(gate(x) * gate_multiplier)) * down_multiplier; the multipliers go
    into the gate rows and down's weights (`fold_multipliers`), which leaves a SwiGLU."""

    def __init__(self, cfg, tp: TensorParallel, ops: KernelOps) -> None:
        super().__init__(
            cfg.hidden_size, cfg.intermediate_size, tp, cfg.hidden_act, bias=cfg.mlp_bias, ops=ops
        )
        self.gate_multiplier, self.down_multiplier = (float(m) for m in cfg.mlp_multipliers)

    def fold_multipliers(self) -> None:
        gate_rows = slice(0, self.gate_up_proj.output_sizes[0])
        scale_output_rows(self.gate_up_proj, self.gate_multiplier, gate_rows)
        scale_output_rows(self.down_proj, self.down_multiplier)
        self.gate_multiplier = self.down_multiplier = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_multiplier == self.down_multiplier == 1.0:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).split(self.gate_up_proj.output_sizes, dim=-1)
        y = up * self.act(scaled(gate, self.gate_multiplier))
        return scaled(self.down_proj(y), self.down_multiplier)


def _mamba(cfg, ctx: ModelContext) -> Mamba2Mixer:
    width = cfg.mamba_n_heads * cfg.mamba_d_head  # mamba_d_ssm, as the config checks
    return bamba_style_mamba2(
        cfg,
        ctx,
        norm_group_size=width // cfg.mamba_n_groups,
        norm_before_gate=cfg.mamba_norm_before_gate,
        gated_norm=cfg.mamba_rms_norm,
        out_proj_bias=cfg.projectors_bias,
        in_proj_multipliers=cfg.ssm_multipliers,
    )


def _attention(cfg, ctx: ModelContext, rotary: RotaryEmbedding) -> Attention:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Attention(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        ops=ctx.ops,
        tp=ctx.tp,
        rotary=rotary,
        bias=cfg.attention_bias,
        # Keys times key_multiplier (RoPE is linear) scale every score by it: folded into
        # the softmax scale, so the KV cache holds the keys as projected.
        scale=head_dim**-0.5 * cfg.key_multiplier,
    )


class FalconH1DecoderLayer(PreNormBlock):
    def __init__(self, cfg, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.mamba = _mamba(cfg, ctx)
        self.self_attn = _attention(cfg, ctx, rotary)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.feed_forward = FalconH1MLP(cfg, ctx.tp, ctx.ops)
        self.ssm_in_multiplier = float(cfg.ssm_in_multiplier)
        self.ssm_out_multiplier = float(cfg.ssm_out_multiplier)
        self.attention_in_multiplier = float(cfg.attention_in_multiplier)
        self.attention_out_multiplier = float(cfg.attention_out_multiplier)

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(kv=self.self_attn.cache_spec(), state=self.mamba.cache_spec())

    def fold_multipliers(self) -> None:
        """The SSM and attention input/output multipliers and in_proj's segment
        multipliers into the projections' weights; afterwards they are all 1."""
        mamba = self.mamba
        scale_input(mamba.in_proj, self.ssm_in_multiplier)
        if mamba.in_proj_scale is not None:
            scale_output_rows(mamba.in_proj, mamba.in_proj_scale)
            mamba.in_proj_scale = None
        scale_output_rows(mamba.out_proj, self.ssm_out_multiplier)
        scale_input(self.self_attn.qkv_proj, self.attention_in_multiplier)
        scale_output_rows(self.self_attn.o_proj, self.attention_out_multiplier)
        self.ssm_in_multiplier = self.ssm_out_multiplier = 1.0
        self.attention_in_multiplier = self.attention_out_multiplier = 1.0
        self.feed_forward.fold_multipliers()

    def forward_residual(self, x, hidden, batch: ForwardBatch, cache: LayerCache):
        ssm = self.mamba(scaled(x, self.ssm_in_multiplier), batch, cache.state)
        attn = self.self_attn(scaled(x, self.attention_in_multiplier), batch, cache.kv)
        mixed = scaled(ssm, self.ssm_out_multiplier) + scaled(attn, self.attention_out_multiplier)
        x, hidden = self.pre_ff_layernorm.add_forward(mixed, hidden)
        return self.feed_forward(x), hidden


class FalconH1ForCausalLM(CausalLM):
    name_rules = QKV_RULES + GATE_UP_RULES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        rotary = RotaryEmbedding.from_hf_config(hf_config)
        self.model = nn.Module()
        self.model.embed_tokens = ScaledEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp, hf_config.embedding_multiplier
        )
        self.model.layers = nn.ModuleList(
            FalconH1DecoderLayer(hf_config, ctx, rotary) for _ in range(hf_config.num_hidden_layers)
        )
        self.model.final_layernorm = RMSNorm(
            hf_config.hidden_size, hf_config.rms_norm_eps, ops=ctx.ops
        )
        self.lm_head = self.make_lm_head(hf_config.vocab_size, hf_config.hidden_size)
        self.lm_head_multiplier = float(hf_config.lm_head_multiplier)
        # The logits are scaled in the weight's dtype, as transformers scales them.
        self.lm_head.out_dtype = None

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return self.model.final_layernorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return scaled(super().compute_logits(hidden), self.lm_head_multiplier)
