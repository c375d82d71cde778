"""NemotronHForCausalLM: a stack of one-mixer residual blocks (RMSNorm -> mixer -> add),
each a Mamba2 mixer with a grouped gated norm, attention without RoPE, a squared-ReLU
MLP or a mixture of experts, in the order of the config's `layers_block_type`.

The mixture of experts (NVIDIA-Nemotron-3 / Nemotron-H MoE): a float32 router with
sigmoid scores, a score-correction bias that moves the choice but not the weights,
grouped top-k (`n_group`, `topk_group`), weights renormalised when `norm_topk_prob` and
times `routed_scaling_factor`; non-gated experts (up -> act -> down) and one shared
expert MLP every token goes through; optionally the routed experts work in a latent space
(`moe_latent_size`).

A block type is a builder in `MIXERS` and the cache it declares in `_CACHE`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.mamba2_mixer import Mamba2Mixer
from ssmserve.layers.mlp import MLP
from ssmserve.layers.moe import PLAIN_EXPERT_NAMES, ExpertCheckpointNames, FusedMoE, Routing
from ssmserve.layers.norm import RMSNorm
from ssmserve.models.base import QKV_RULES, CausalLM, ModelContext, NameRule, PreNormBlock


def _mamba2(cfg, ctx: ModelContext) -> Mamba2Mixer:
    intermediate = cfg.mamba_num_heads * cfg.mamba_head_dim
    return Mamba2Mixer(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        state_size=cfg.ssm_state_size,
        n_groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel,
        chunk_size=cfg.chunk_size,
        norm_eps=cfg.layer_norm_epsilon,
        ops=ctx.ops,
        tp=ctx.tp,
        activation=cfg.mamba_hidden_act,
        # As transformers' NemotronH mixer: dt is clamped below at time_step_min, with no
        # upper limit (the config's time_step_limit is not read).
        time_step_limit=(cfg.time_step_min, float("inf")),
        use_bias=cfg.use_bias,
        use_conv_bias=cfg.use_conv_bias,
        norm_group_size=intermediate // cfg.n_groups,
    )


def _attention(cfg, ctx: ModelContext) -> Attention:
    # No RoPE, and no projection biases whatever `attention_bias` says (as transformers).
    return Attention(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        ops=ctx.ops,
        tp=ctx.tp,
        rotary=None,
    )


def _mlp(cfg, ctx: ModelContext) -> MLP:
    return MLP(
        cfg.hidden_size, cfg.intermediate_size, ctx.tp, cfg.mlp_hidden_act, bias=cfg.mlp_bias
    )


def moe_routing(cfg) -> Routing:
    return Routing(
        top_k=cfg.num_experts_per_tok,
        scoring="sigmoid",
        renormalize=cfg.norm_topk_prob,
        num_groups=cfg.n_group,
        topk_groups=cfg.topk_group,
        routed_scaling_factor=float(cfg.routed_scaling_factor),
    )


def _moe(cfg, ctx: ModelContext) -> FusedMoE:
    return FusedMoE(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.n_routed_experts,
        routing=moe_routing(cfg),
        ops=ctx.ops,
        tp=ctx.tp,
        activation=cfg.mlp_hidden_act,
        gated=False,
        correction_bias=True,
        router_in_float32=True,
        # As transformers: a shared-expert size of 0 (or null) means intermediate_size.
        shared_intermediate_size=cfg.moe_shared_expert_intermediate_size or cfg.intermediate_size,
        shared_bias=cfg.mlp_bias,
        latent_size=cfg.moe_latent_size or 0,
        latent_bias=cfg.mlp_bias,
    )


# transformers' block type names (5.x: Mamba2 is "linear_attention", attention is
# "full_attention"; older configs are renamed when the config loads).
MIXERS: dict[str, Callable[..., nn.Module]] = {
    "linear_attention": _mamba2,
    "full_attention": _attention,
    "mlp": _mlp,
    "moe": _moe,
}
_CACHE = {"linear_attention": "state", "full_attention": "kv"}


def block_types(cfg) -> list[str]:
    """The config's per-layer block types, each one this file builds, or a clear error."""
    types = list(cfg.layers_block_type)
    for i, kind in enumerate(types):
        if kind not in MIXERS:
            raise ValueError(
                f"layers_block_type[{i}] = {kind!r} is not a NemotronH block type; "
                f"supported: {', '.join(MIXERS)}"
            )
    return types


class NemotronHBlock(PreNormBlock):
    def __init__(self, cfg, block_type: str, ctx: ModelContext) -> None:
        super().__init__()
        self.cache_kind = _CACHE.get(block_type)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, ops=ctx.ops)
        self.mixer = MIXERS[block_type](cfg, ctx)

    def cache_spec(self) -> LayerCacheSpec:
        if self.cache_kind is None:
            return LayerCacheSpec()
        return LayerCacheSpec(**{self.cache_kind: self.mixer.cache_spec()})

    def pre_norm(self) -> RMSNorm:
        return self.norm

    def forward_residual(self, x, hidden, batch: ForwardBatch, cache: LayerCache):
        if self.cache_kind is None:
            return self.mixer(x), hidden
        return self.mixer(x, batch, getattr(cache, self.cache_kind)), hidden


# The checkpoint names the router `gate`; each expert's up_proj / down_proj is its own
# tensor (`mixer.experts.N.up_proj.weight`), loaded into the fused experts.
MOE_RULES: tuple[NameRule, ...] = ((".mixer.gate.", ".mixer.router.", None),)


class NemotronHForCausalLM(ExpertCheckpointNames, CausalLM):
    name_rules = QKV_RULES + MOE_RULES
    expert_name_rules = PLAIN_EXPERT_NAMES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        # transformers never ties NemotronH's LM head to the embeddings, whatever
        # tie_word_embeddings says: the checkpoint always has its own lm_head.weight.
        self.tie_word_embeddings = False
        self.backbone = nn.Module()
        self.backbone.embeddings = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp
        )
        self.backbone.layers = nn.ModuleList(
            NemotronHBlock(hf_config, kind, ctx) for kind in block_types(hf_config)
        )
        self.backbone.norm_f = RMSNorm(
            hf_config.hidden_size, hf_config.layer_norm_epsilon, ops=ctx.ops
        )
        self.lm_head = self.make_lm_head(hf_config.vocab_size, hf_config.hidden_size)

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.backbone.embeddings

    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def final_norm(self) -> nn.Module:
        return self.backbone.norm_f
