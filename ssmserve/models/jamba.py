"""JambaForCausalLM: Mamba1 layers (RMS norms with weights on dt, B and C) with attention
every `attn_layer_period` layers from `attn_layer_offset` (no RoPE), each followed by a
mixture of experts every `expert_layer_period` layers from `expert_layer_offset` (softmax
over all experts, top-k, not renormalised) or else a SwiGLU MLP."""

from __future__ import annotations

from torch import nn

from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.mamba_mixer import MambaMixer
from ssmserve.layers.mlp import GatedMLP
from ssmserve.layers.moe import ExpertCheckpointNames, FusedMoE, Routing
from ssmserve.layers.norm import RMSNorm
from ssmserve.models.base import (
    GATE_UP_RULES,
    QKV_RULES,
    CausalLM,
    ModelContext,
    PreNormBlock,
    llama_attention,
)


def layer_pattern(cfg) -> list[tuple[str, bool]]:
    """(mixer kind, whether the feed-forward is a mixture of experts) per layer."""
    return [
        (
            "attention" if i % cfg.attn_layer_period == cfg.attn_layer_offset else "mamba",
            cfg.num_experts > 1 and i % cfg.expert_layer_period == cfg.expert_layer_offset,
        )
        for i in range(cfg.num_hidden_layers)
    ]


class JambaDecoderLayer(PreNormBlock):
    def __init__(self, cfg, kind: str, moe: bool, ctx: ModelContext) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        if kind == "attention":
            self.self_attn = llama_attention(cfg, ctx, rotary=None)
        else:
            self.mamba = MambaMixer(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.mamba_expand * cfg.hidden_size,
                state_size=cfg.mamba_d_state,
                conv_kernel=cfg.mamba_d_conv,
                time_step_rank=cfg.mamba_dt_rank,
                ops=ctx.ops,
                tp=ctx.tp,
                activation=cfg.hidden_act,
                use_bias=cfg.mamba_proj_bias,
                use_conv_bias=cfg.mamba_conv_bias,
                bcdt_rms_eps=cfg.rms_norm_eps,
                bcdt_norm_weights=True,
            )
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        if moe:
            self.feed_forward = FusedMoE(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_experts=cfg.num_experts,
                routing=Routing(top_k=cfg.num_experts_per_tok),
                ops=ctx.ops,
                tp=ctx.tp,
                activation=cfg.hidden_act,
            )
        else:
            self.feed_forward = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, ctx.tp, cfg.hidden_act, ops=ctx.ops
            )

    def cache_spec(self) -> LayerCacheSpec:
        if self.kind == "attention":
            return LayerCacheSpec(kv=self.self_attn.cache_spec())
        return LayerCacheSpec(state=self.mamba.cache_spec())

    def forward_residual(self, x, hidden, batch: ForwardBatch, cache: LayerCache):
        if self.kind == "attention":
            out = self.self_attn(x, batch, cache.kv)
        else:
            out = self.mamba(x, batch, cache.state)
        x, hidden = self.pre_ff_layernorm.add_forward(out, hidden)
        return self.feed_forward(x), hidden


class JambaForCausalLM(ExpertCheckpointNames, CausalLM):
    name_rules = QKV_RULES + GATE_UP_RULES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp
        )
        self.model.layers = nn.ModuleList(
            JambaDecoderLayer(hf_config, kind, moe, ctx) for kind, moe in layer_pattern(hf_config)
        )
        self.model.final_layernorm = RMSNorm(
            hf_config.hidden_size, hf_config.rms_norm_eps, ops=ctx.ops
        )
        self.lm_head = self.make_lm_head(hf_config.vocab_size, hf_config.hidden_size)

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return self.model.final_layernorm
