"""MambaForCausalLM and FalconMambaForCausalLM: Mamba1 blocks, residual kept in float32.

`MambaStyleLM` is the shared attention-free backbone (embeddings, pre-norm residual
blocks, norm_f, lm_head) that Mamba2ForCausalLM reuses with a different mixer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import LayerCache, LayerCacheSpec
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.mamba_mixer import MambaMixer
from ssmserve.layers.norm import RMSNorm
from ssmserve.models.base import CausalLM, ModelContext


class ResidualMixerBlock(nn.Module):
    """norm -> mixer -> + residual, as HF's Mamba/Mamba2 blocks do (the model runs the
    blocks together: `MambaStyleLM.run_layers`)."""

    def __init__(self, cfg, mixer: nn.Module, ops: KernelOps) -> None:
        super().__init__()
        self.residual_in_fp32 = getattr(cfg, "residual_in_fp32", True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, ops=ops)
        self.mixer = mixer

    def cache_spec(self) -> LayerCacheSpec:
        return LayerCacheSpec(state=self.mixer.cache_spec())


class MambaStyleLM(CausalLM):
    """backbone.{embeddings, layers, norm_f} + lm_head; subclasses give the mixer."""

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__(hf_config, ctx)
        self.backbone = nn.Module()
        self.backbone.embeddings = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, ctx.tp
        )
        self.backbone.layers = nn.ModuleList(
            ResidualMixerBlock(hf_config, self.make_mixer(hf_config, ctx), ctx.ops)
            for _ in range(hf_config.num_hidden_layers)
        )
        self.backbone.norm_f = RMSNorm(
            hf_config.hidden_size, hf_config.layer_norm_epsilon, ops=ctx.ops
        )
        self.lm_head = self.make_lm_head(hf_config.vocab_size, hf_config.hidden_size)

    def make_mixer(self, cfg, ctx: ModelContext) -> nn.Module:
        raise NotImplementedError

    def input_embeddings(self) -> VocabParallelEmbedding:
        return self.backbone.embeddings

    def decoder_layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def final_norm(self) -> nn.Module:
        return self.backbone.norm_f

    def forward(self, batch: ForwardBatch, caches: list[LayerCache], received=None):
        out = super().forward(batch, caches, received)
        return out.to(self.lm_head.weight.dtype) if isinstance(out, torch.Tensor) else out

    def embeds_in_first_norm(self) -> bool:
        # On one rank the first block gathers the embedding in its norm's launch
        # (`run_layers`); a vocab-parallel embedding sums its ranks' rows first.
        return self.ctx.tp.size == 1 and self.stage.is_first and bool(self.stage.layers)

    def run_layers(
        self, hidden: torch.Tensor | None, batch: ForwardBatch, caches: list[LayerCache]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks as HF runs them, each adding the residual (in float32 when
        residual_in_fp32) and feeding the sum on, with the same roundings; each add is
        fused into the next block's norm (`add_rms_norm`: one kernel for the add, the
        cast and the norm), and with `hidden` None (`embeds_in_first_norm`) the
        embedding into the first block's (`embed_rms_norm`). Returns (the residual, the
        last block's output not yet added), as `CausalLM.run_layers`."""
        layers = self.decoder_layers()
        residual, out = hidden, None
        for i in self.stage.layers:
            block = layers[i]
            if out is None and hidden is None:  # the first block of the first stage
                table = self.input_embeddings().weight
                x, residual = self.ctx.ops.embed_rms_norm(
                    batch.input_ids,
                    table,
                    block.norm.weight,
                    eps=block.norm.eps,
                    sum_dtype=torch.float32 if block.residual_in_fp32 else table.dtype,
                )
            elif out is None:  # the first block, its input embedded apart (TP) or sent
                x = block.norm(hidden.to(block.norm.weight.dtype))
                residual = hidden.float() if block.residual_in_fp32 else hidden
            else:
                x, residual = self.ctx.ops.add_rms_norm(
                    out, residual, block.norm.weight, eps=block.norm.eps
                )
            out = block.mixer(x, batch, caches[i].state)
        return residual, out

    def final_add_norm(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """norm_f of residual + out as HF runs it (the sum normalised in the residual's
        dtype, float32 with residual_in_fp32), in the LM head's dtype: the add, the norm
        and the cast in one kernel."""
        norm = self.final_norm()
        y, _ = self.ctx.ops.add_rms_norm(out, residual, norm.weight, eps=norm.eps, cast_sum=False)
        return y

    @property
    def residual_dtype(self) -> torch.dtype:
        if getattr(self.hf_config, "residual_in_fp32", True):
            return torch.float32
        return super().residual_dtype


class MambaForCausalLM(MambaStyleLM):
    falcon = False

    def make_mixer(self, cfg, ctx: ModelContext) -> nn.Module:
        rank = cfg.time_step_rank
        if rank == "auto":
            rank = math.ceil(cfg.hidden_size / 16)
        return MambaMixer(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            state_size=cfg.state_size,
            conv_kernel=cfg.conv_kernel,
            time_step_rank=int(rank),
            ops=ctx.ops,
            tp=ctx.tp,
            activation=cfg.hidden_act,
            use_bias=cfg.use_bias,
            use_conv_bias=cfg.use_conv_bias,
            bcdt_rms_eps=cfg.mixer_rms_eps if self.falcon else None,
        )


class FalconMambaForCausalLM(MambaForCausalLM):
    falcon = True
