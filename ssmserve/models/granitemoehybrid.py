"""GraniteMoeHybridForCausalLM (Granite 4.0-H): Mamba2 and attention layers from
`layer_types`, each followed by a mixture of experts (top-k of the router logits, softmax
over the chosen) plus a shared SwiGLU MLP, or by the shared MLP alone when
`num_local_experts` is 0. µP-style multipliers: embeddings times `embedding_multiplier`,
each residual branch times `residual_multiplier`, attention scale `attention_multiplier`,
logits divided by `logits_scaling`. Attention uses RoPE only when `position_embedding_type`
is "rope". The residual multiplier is folded into the weights of each branch's last
projection once they are loaded (`fold_constants`), so decode runs no multiply for it."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.linear import scale_output_rows
from ssmserve.layers.mlp import GatedMLP
from ssmserve.layers.moe import FusedMoE, Routing
from ssmserve.layers.norm import RMSNorm
from ssmserve.layers.rotary import RotaryEmbedding
from ssmserve.models.base import (
    QKV_RULES,
    CausalLM,
    ModelContext,
    NameRule,
    PreNormBlock,
    bamba_style_mamba2,
    scaled,
)

# transformers' config maps the legacy names ("mamba", "attention") to these.
LAYER_KINDS = {"linear_attention": "mamba2", "full_attention": "attention"}
NO_ROPE = (None, "nope")

# The checkpoint's legacy names (as the published weights and save_pretrained have them).
GRANITE_RULES: tuple[NameRule, ...] = (
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj", None),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj", None),
    (".block_sparse_moe.router.layer.", ".block_sparse_moe.router.", None),
    (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj.", None),
    (".shared_mlp.output_linear.", ".shared_mlp.down_proj.", None),
)


def layer_kinds(cfg) -> list[str]:
    kinds = []
    for i, name in enumerate(cfg.layer_types):
        if name not in LAYER_KINDS:
            raise ValueError(
                f"layer_types[{i}] = {name!r} is not supported; use one of "
                f"{', '.join(sorted(LAYER_KINDS))}"
            )
        kinds.append(LAYER_KINDS[name])
    return kinds


def granite_rotary(cfg) -> RotaryEmbedding | None:
    kind = getattr(cfg, "position_embedding_type", None)
    if kind in NO_ROPE:
        return None
    if kind != "rope":
        raise ValueError(
            f"position_embedding_type = {kind!r} is not supported; use 'rope', 'nope' or null"
        )
    return RotaryEmbedding.from_hf_config(cfg)


class ScaledEmbedding(VocabParallelEmbedding):
    """The input embedding times `embedding_multiplier` (a tied LM head shares the weight,
    not the multiplier)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, multiplier: float
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier


class GraniteMoeHybridDecoderLayer(PreNormBlock):
    def __init__(self, cfg, kind: str, ctx: ModelContext, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        self.kind, self.tp = kind, ctx.tp
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        if kind == "attention":
            heads = cfg.num_attention_heads
            self.self_attn = Attention(
                hidden_size=cfg.hidden_size,
                num_heads=heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.hidden_size // heads,
                ops=ctx.ops,
                tp=ctx.tp,
                rotary=rotary,
                bias=cfg.attention_bias,
                scale=cfg.attention_multiplier,
            )
        else:
            self.mamba = bamba_style_mamba2(cfg, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        # With experts, routed and shared outputs are partial sums under TP, reduced once.
        self.block_sparse_moe = None
        if cfg.num_local_experts > 0:
            self.block_sparse_moe = FusedMoE(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_experts=cfg.num_local_experts,
                routing=Routing(top_k=cfg.num_experts_per_tok, renormalize=True),
                ops=ctx.ops,
                tp=ctx.tp,
                activation=cfg.hidden_act,
                reduce_results=False,
            )
        self.shared_mlp = GatedMLP(
            cfg.hidden_size,
            cfg.shared_intermediate_size,
            ctx.tp,
            cfg.hidden_act,
            reduce_results=self.block_sparse_moe is None,
            ops=ctx.ops,
        )

    def cache_spec(self) -> LayerCacheSpec:
        if self.kind == "attention":
            return LayerCacheSpec(kv=self.self_attn.cache_spec())
        return LayerCacheSpec(state=self.mamba.cache_spec())

    @torch.no_grad()
    def fold_multipliers(self) -> None:
        """residual_multiplier into the mixer's output projection, the experts' down
        projections and the shared MLP's; afterwards it is 1."""
        m = self.residual_multiplier
        mixer_out = self.self_attn.o_proj if self.kind == "attention" else self.mamba.out_proj
        scale_output_rows(mixer_out, m)
        scale_output_rows(self.shared_mlp.down_proj, m)
        if self.block_sparse_moe is not None:
            down = self.block_sparse_moe.experts.down_proj
            down.copy_(down.float() * m)
        self.residual_multiplier = 1.0

    def forward_residual(self, x, hidden, batch: ForwardBatch, cache: LayerCache):
        if self.kind == "attention":
            x = self.self_attn(x, batch, cache.kv)
        else:
            x = self.mamba(x, batch, cache.state)
        x, hidden = self.post_attention_layernorm.add_forward(
            scaled(x, self.residual_multiplier), hidden
        )
        if self.block_sparse_moe is None:
            x = self.shared_mlp(x)
        else:
            x = self.tp.all_reduce(self.block_sparse_moe(x) + self.shared_mlp(x))
        return scaled(x, self.residual_multiplier), hidden


class GraniteMoeHybridForCausalLM(CausalLM):
    name_rules = QKV_RULES + GRANITE_RULES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        rotary = granite_rotary(hf_config)
        self.logits_scaling = hf_config.logits_scaling
        self.model = nn.Module()
        self.model.embed_tokens = ScaledEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp, hf_config.embedding_multiplier
        )
        self.model.layers = nn.ModuleList(
            GraniteMoeHybridDecoderLayer(hf_config, kind, ctx, rotary)
            for kind in layer_kinds(hf_config)
        )
        self.model.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, ops=ctx.ops)
        self.lm_head = self.make_lm_head(hf_config.vocab_size, hf_config.hidden_size)
        # The logits are scaled in the weight's dtype, as transformers scales them.
        self.lm_head.out_dtype = None

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return self.model.norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
