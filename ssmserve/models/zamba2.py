"""Zamba2ForCausalLM: Mamba2 layers; at the `hybrid` depths of `layers_block_type` a shared
transformer block runs first on [hidden, original embeddings] (2 * hidden wide), and its
output, through a per-depth linear, is added to that depth's Mamba2 input.

`num_mem_blocks` shared blocks serve the hybrid depths in turn (use u of the
`len(hybrid)` uses runs block u % num_mem_blocks). A block's weights are one module,
registered at every depth that uses it; its per-use LoRA adapters (on q/k/v when
`use_shared_attention_adapter`, always on the MLP's gate_up) are indexed by use, as in
the checkpoint. Each hybrid depth declares its own KV cache, so two uses of one block
never share K/V.

Tensor parallelism: the block splits as Attention and GatedMLP do; a LoRA's A is
replicated and its B split like the projection it adds to (exact, no communication);
the per-depth hidden x hidden linear is replicated: reading it whole costs about 6 us
per use at Zamba2-7B's size on an H200 (26 MB), less than the all-reduce per use that
splitting it would add.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ssmserve.layers.attention import Attention
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import KVCache, LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.linear import ReplicatedLinear
from ssmserve.layers.lora import LoRA
from ssmserve.layers.mamba2_mixer import Mamba2Mixer
from ssmserve.layers.mlp import GatedMLP
from ssmserve.layers.norm import RMSNorm
from ssmserve.layers.rotary import RotaryEmbedding
from ssmserve.models.base import QKV_RULES, CausalLM, ModelContext

MAMBA_KINDS = ("linear_attention", "mamba")  # transformers' name and the checkpoints' older one
# transformers builds the Mamba2 gated norm with this epsilon, whatever rms_norm_eps says.
MIXER_NORM_EPS = 1e-5
_SHARED_NAME = re.compile(r"model\.layers\.(\d+)\.shared_transformer\.")


def hybrid_layer_ids(cfg) -> list[int]:
    """Depths that run a shared block, after checking the config is one this file builds."""
    kinds = list(cfg.layers_block_type)
    unknown = sorted({k for k in kinds if k != "hybrid" and k not in MAMBA_KINDS})
    if unknown:
        raise ValueError(
            f"layers_block_type has {', '.join(map(repr, unknown))}; Zamba2 layers are "
            f"'hybrid' or {' / '.join(map(repr, MAMBA_KINDS))}"
        )
    if len(kinds) != cfg.num_hidden_layers:
        raise ValueError(
            f"layers_block_type lists {len(kinds)} layers but num_hidden_layers = "
            f"{cfg.num_hidden_layers}; make them agree"
        )
    if cfg.num_mem_blocks < 1:
        raise ValueError(f"num_mem_blocks = {cfg.num_mem_blocks}; it must be at least 1")
    if getattr(cfg, "use_shared_mlp_adapter", True) is False:
        raise ValueError(
            "use_shared_mlp_adapter = False is not supported: transformers' Zamba2 always "
            "applies the shared MLP's adapters, so checkpoints carry them"
        )
    if cfg.use_shared_attention_adapter and cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError(
            f"use_shared_attention_adapter = True needs num_key_value_heads "
            f"({cfg.num_key_value_heads}) = num_attention_heads ({cfg.num_attention_heads}): "
            "the k/v adapters are as wide as the query projection"
        )
    inner = int(cfg.mamba_expand * cfg.hidden_size)
    if cfg.n_mamba_heads * cfg.mamba_headdim != inner:
        raise ValueError(
            f"n_mamba_heads ({cfg.n_mamba_heads}) x mamba_headdim ({cfg.mamba_headdim}) must "
            f"equal mamba_expand x hidden_size ({inner})"
        )
    return [i for i, kind in enumerate(kinds) if kind == "hybrid"]


def _per_use(uses, make) -> nn.ModuleDict:
    """One module per use of a shared block, keyed as the checkpoint's adapter lists."""
    return nn.ModuleDict({str(u): make() for u in uses})


class Zamba2Attention(Attention):
    """Attention over the 2 * hidden block input (head_dim = 2 * hidden / heads, scores
    scaled by (head_dim / 2) ** -0.5), out to hidden, with per-use q/k/v adapters."""

    def __init__(self, cfg, ctx: ModelContext, rotary: RotaryEmbedding | None, uses) -> None:
        width = 2 * cfg.hidden_size
        head_dim = cfg.attention_head_dim
        super().__init__(
            hidden_size=width,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            ops=ctx.ops,
            tp=ctx.tp,
            rotary=rotary,
            scale=(head_dim / 2) ** -0.5,
            out_features=cfg.hidden_size,
        )
        self.adapted = bool(cfg.use_shared_attention_adapter)
        if self.adapted:
            q, k, v = self.qkv_proj.segments
            rank = cfg.adapter_rank
            self.linear_q_adapter_list = _per_use(uses, lambda: LoRA(width, rank, [q]))
            self.linear_k_adapter_list = _per_use(uses, lambda: LoRA(width, rank, [k]))
            self.linear_v_adapter_list = _per_use(uses, lambda: LoRA(width, rank, [v]))

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache, use: int
    ) -> torch.Tensor:
        if not self.adapted:
            return super().forward(x, batch, cache)
        u = str(use)
        delta = torch.cat(
            [
                self.linear_q_adapter_list[u](x),
                self.linear_k_adapter_list[u](x),
                self.linear_v_adapter_list[u](x),
            ],
            dim=-1,
        )
        return super().forward(x, batch, cache, qkv_delta=delta)


class Zamba2MLP(GatedMLP):
    """The checkpoint's gate_up_proj is already fused (gate rows, then up rows)."""

    def __init__(self, cfg, ctx: ModelContext, uses) -> None:
        super().__init__(
            cfg.hidden_size,
            cfg.intermediate_size,
            ctx.tp,
            cfg.hidden_act,
            cfg.add_bias_linear,
            ops=ctx.ops,
        )
        segments = self.gate_up_proj.segments
        self.gate_up_proj_adapter_list = _per_use(
            uses, lambda: LoRA(cfg.hidden_size, cfg.adapter_rank, segments)
        )

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        return super().forward(x, gate_up_delta=self.gate_up_proj_adapter_list[str(use)](x))


class Zamba2SharedBlock(nn.Module):
    """RMSNorm over [hidden, embeds] -> attention -> RMSNorm -> gated MLP, with no residual
    inside (the hybrid depth adds the result to its Mamba2 layer's input)."""

    def __init__(self, cfg, ctx: ModelContext, rotary: RotaryEmbedding | None, uses) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(2 * cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.self_attn = Zamba2Attention(cfg, ctx, rotary, uses)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.feed_forward = Zamba2MLP(cfg, ctx, uses)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        use: int,
    ) -> torch.Tensor:
        x = self.input_layernorm(torch.cat([hidden, embeds], dim=-1))
        x = self.pre_ff_layernorm(self.self_attn(x, batch, kv, use))
        return self.feed_forward(x, use)


class Zamba2MambaLayer(nn.Module):
    """norm -> Mamba2 -> + residual. Every Zamba2 position takes the original embeddings
    (`embeds`); only shared blocks read them. At a hybrid depth `shared` (the block's
    projected output) is added to the norm's input, not to the residual."""

    def __init__(self, cfg, ctx: ModelContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        inner = int(cfg.mamba_expand * cfg.hidden_size)
        self.mamba = Mamba2Mixer(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.n_mamba_heads,
            head_dim=cfg.mamba_headdim,
            state_size=cfg.mamba_d_state,
            n_groups=cfg.mamba_ngroups,
            conv_kernel=cfg.mamba_d_conv,
            chunk_size=cfg.chunk_size,
            norm_eps=MIXER_NORM_EPS,
            ops=ctx.ops,
            tp=ctx.tp,
            # transformers' Zamba2 mixer: SiLU conv, dt floored at time_step_min, conv bias
            # always present (hidden_act and use_conv_bias do not reach it).
            activation="silu",
            time_step_limit=(cfg.time_step_min, float("inf")),
            use_bias=cfg.add_bias_linear,
            use_conv_bias=True,
            norm_group_size=inner // cfg.mamba_ngroups,
        )

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(state=self.mamba.cache_spec())

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        batch: ForwardBatch,
        cache: LayerCache,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = hidden if shared is None else hidden + shared
        return hidden + self.mamba(self.input_layernorm(x), batch, cache.state)


class Zamba2HybridLayer(nn.Module):
    """Use `use` of a shared block, its per-depth linear, then this depth's Mamba2 layer;
    the depth's cache holds the block's K/V for this use and the Mamba2 state."""

    def __init__(self, cfg, ctx: ModelContext, block: Zamba2SharedBlock, use: int) -> None:
        super().__init__()
        self.use = use
        self.shared_transformer = block
        self.linear = ReplicatedLinear(cfg.hidden_size, cfg.hidden_size)
        self.mamba_decoder = Zamba2MambaLayer(cfg, ctx)

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(
            kv=self.shared_transformer.self_attn.cache_spec(),
            state=self.mamba_decoder.mamba.cache_spec(),
        )

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, batch: ForwardBatch, cache: LayerCache
    ) -> torch.Tensor:
        shared = self.shared_transformer(hidden, embeds, batch, cache.kv, self.use)
        return self.mamba_decoder(hidden, embeds, batch, cache, self.linear(shared))


class Zamba2ForCausalLM(CausalLM):
    name_rules = QKV_RULES

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        cfg = hf_config
        hybrid = hybrid_layer_ids(cfg)
        num_blocks = min(cfg.num_mem_blocks, len(hybrid))
        rotary = RotaryEmbedding.from_hf_config(cfg) if cfg.use_mem_rope else None
        blocks = [
            Zamba2SharedBlock(cfg, ctx, rotary, uses=range(b, len(hybrid), num_blocks))
            for b in range(num_blocks)
        ]
        use_of = {layer: u for u, layer in enumerate(hybrid)}
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.tp)
        self.model.layers = nn.ModuleList(
            Zamba2HybridLayer(cfg, ctx, blocks[use_of[i] % num_blocks], use_of[i])
            if i in use_of
            else Zamba2MambaLayer(cfg, ctx)
            for i in range(cfg.num_hidden_layers)
        )
        self.model.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops=ctx.ops)
        self.lm_head = self.make_lm_head(cfg.vocab_size, cfg.hidden_size)
        # A block's parameters are named at its first use, as the checkpoint stores them.
        # Copies stored at later uses load into the same block (the loader refuses copies
        # that differ): transformers ties the blocks only when tie_word_embeddings is
        # true, so an untied checkpoint it saved holds one copy per use.
        self._first_use_layer = {layer: hybrid[u % num_blocks] for layer, u in use_of.items()}

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self) -> nn.Module:
        return self.model.final_layernorm

    def forward(self, batch: ForwardBatch, caches: list[LayerCache], received=None):
        # The shared blocks read the original embeddings at every depth, so a pipeline
        # stage sends them on with the hidden state.
        if received is None:
            hidden = embeds = self.model.embed_tokens(batch.input_ids)
        else:
            hidden, embeds = received["hidden"], received["embeds"]
        # Each Mamba2 layer's residual add is left to the next layer's norm (add_rms_norm:
        # one kernel, the same roundings). At a hybrid depth the norm reads hidden plus
        # the shared block's projected output, while the residual stays hidden.
        out = None  # the last Mamba2 layer's output, not yet added to `hidden`
        for i in self.stage.layers:
            layer = self.model.layers[i]
            if isinstance(layer, Zamba2HybridLayer):
                if out is not None:
                    hidden, out = hidden + out, None
                shared = layer.linear(
                    layer.shared_transformer(hidden, embeds, batch, caches[i].kv, layer.use)
                )
                layer = layer.mamba_decoder
                x, _ = layer.input_layernorm.add_forward(shared, hidden)
            elif out is None:
                x = layer.input_layernorm(hidden)
            else:
                x, hidden = layer.input_layernorm.add_forward(out, hidden)
            out = layer.mamba(x, batch, caches[i].state)
        if not self.stage.is_last:
            return {"hidden": hidden if out is None else hidden + out, "embeds": embeds}
        return self.final_norm()(hidden) if out is None else self.final_add_norm(out, hidden)

    def intermediate_spec(self, num_tokens: int):
        spec = super().intermediate_spec(num_tokens)
        spec["embeds"] = ((num_tokens, self.hf_config.hidden_size), self.lm_head.weight.dtype)
        return spec

    def checkpoint_to_param(self, name: str) -> tuple[str, int | None]:
        match = _SHARED_NAME.match(name)
        if match and int(match.group(1)) in self._first_use_layer:
            first = self._first_use_layer[int(match.group(1))]
            name = f"model.layers.{first}.shared_transformer.{name[match.end() :]}"
        return super().checkpoint_to_param(name)
