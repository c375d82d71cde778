"""BambaForCausalLM: Mamba2 layers with a few attention layers (RoPE on half the head dim),
each followed by a SwiGLU MLP. The per-layer pattern comes from `attn_layer_indices`."""

from __future__ import annotations

from torch import nn

from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
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
    llama_attention,
)


def layer_kinds(cfg) -> list[str]:
    attn = set(getattr(cfg, "attn_layer_indices", None) or [])
    return ["attention" if i in attn else "mamba2" for i in range(cfg.num_hidden_layers)]


class BambaDecoderLayer(PreNormBlock):
    def __init__(self, cfg, kind: str, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        if kind == "attention":
            self.self_attn = llama_attention(cfg, ctx, rotary)
        else:
            self.mamba = bamba_style_mamba2(cfg, ctx)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.feed_forward = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            ctx.tp,
            cfg.hidden_act,
            bias=getattr(cfg, "mlp_bias", False),
            ops=ctx.ops,
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


class BambaForCausalLM(CausalLM):
    name_rules = QKV_RULES + GATE_UP_RULES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        rotary = RotaryEmbedding.from_hf_config(hf_config)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp
        )
        self.model.layers = nn.ModuleList(
            BambaDecoderLayer(hf_config, kind, ctx, rotary) for kind in layer_kinds(hf_config)
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
