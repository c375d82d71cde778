"""LlamaForCausalLM: the pure-attention baseline we compare speed against."""

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
    llama_attention,
)


class LlamaDecoderLayer(PreNormBlock):
    def __init__(self, cfg, ctx: ModelContext, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.self_attn = llama_attention(cfg, ctx, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.mlp = GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            ctx.tp,
            cfg.hidden_act,
            bias=getattr(cfg, "mlp_bias", False),
            ops=ctx.ops,
        )

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(kv=self.self_attn.cache_spec())

    def forward_residual(self, x, hidden, batch: ForwardBatch, cache: LayerCache):
        out = self.self_attn(x, batch, cache.kv)
        x, hidden = self.post_attention_layernorm.add_forward(out, hidden)
        return self.mlp(x), hidden


class LlamaForCausalLM(CausalLM):
    name_rules = QKV_RULES + GATE_UP_RULES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        rotary = RotaryEmbedding.from_hf_config(hf_config)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp
        )
        self.model.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, ctx, rotary) for _ in range(hf_config.num_hidden_layers)
        )
        self.model.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ops=ctx.ops)
        self.lm_head = self.make_lm_head(hf_config.vocab_size, hf_config.hidden_size)

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return self.model.norm
