"""Mixture of experts: a router picks top-k experts per token, fused expert MLPs run over
the routed tokens (`ops.fused_moe`), optional shared experts see every token.

Routing covers the families' variants: softmax or sigmoid scores, renormalised over the
chosen experts or not, a score-correction bias that moves the choice but not the weights,
grouped top-k (keep the `topk_groups` best of `num_groups` expert groups, then choose
within them) and a routed scaling factor (DeepSeek-V3 / Nemotron-H style). Experts may
work in a latent space smaller than the hidden size, with a projection into it before
them and one back after (Nemotron-H's `moe_latent_size`).

Expert weights are stored fused, [E, 2I, H] (gate rows, then up rows) or [E, I, H] for
non-gated experts, and [E, H, I] for down. Tensor parallelism splits every expert's
intermediate dim evenly (gate/up by rows, down by columns, as in a dense MLP); the router
is replicated and the partial sums of routed and shared experts are all-reduced once.
Checkpoints storing each expert as its own tensors (`experts.N.gate_proj.weight`) load
through `ExpertCheckpointNames`; fused 3D tensors load whole.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import KernelOps
from ssmserve.kernels.moe import ACTIVATIONS, SCORING, moe_route_ref
from ssmserve.layers.linear import ReplicatedLinear, Segment, load_replicated, replicated_parameter
from ssmserve.layers.mlp import MLP, GatedMLP


@dataclass(frozen=True)
class Routing:
    """How router logits choose `top_k` experts and weigh them."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int) -> None:
        """Raise a clear error for a routing this number of experts cannot do."""
        if self.scoring not in SCORING:
            raise ValueError(f"router scoring {self.scoring!r} is not supported; use {SCORING}")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok = {self.top_k} must lie in [1, {num_experts}] "
                f"(the number of experts)"
            )
        if self.num_groups > 1:
            per_group = num_experts // self.num_groups
            if num_experts % self.num_groups or per_group < 2:
                raise ValueError(
                    f"n_group = {self.num_groups} must divide the {num_experts} experts into "
                    "groups of at least 2"
                )
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(
                    f"topk_group = {self.topk_groups} must lie in [1, n_group = {self.num_groups}]"
                )
            if self.topk_groups * per_group < self.top_k:
                raise ValueError(
                    f"topk_group = {self.topk_groups} groups of {per_group} experts hold "
                    f"fewer than num_experts_per_tok = {self.top_k}"
                )


def select_experts(
    logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token and their weights, in PyTorch (`moe_route_ref`).

    Args:
        logits: [T, E] router logits. correction_bias: [E] added to the scores to choose
            experts (the weights stay the uncorrected scores), or None.

    Returns:
        weights [T, K] float32, ids [T, K] int64.
    """
    return moe_route_ref(logits, correction_bias, **dataclasses.asdict(routing))


def _load_expert_rows(param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    """param [E, rows, H]: per expert its segments stacked (gate, then up), this rank's
    rows of each. shard_id (expert, segment) loads one checkpoint tensor [size, H];
    None loads the fused [E, sum of sizes, H] tensor."""
    segments: tuple[Segment, ...] = param.segments
    offsets = [sum(len(s.rows) for s in segments[:j]) for j in range(len(segments))]
    if shard_id is None:
        whole = (param.shape[0], sum(s.size for s in segments), param.shape[2])
        if tuple(loaded.shape) != whole:
            raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, expected {whole}")
        pieces = loaded.split([s.size for s in segments], dim=1)
        for seg, offset, full in zip(segments, offsets, pieces, strict=True):
            rows = full.narrow(1, seg.rows.start, len(seg.rows))
            param.data[:, offset : offset + len(seg.rows)].copy_(rows)
        return
    expert, index = shard_id
    seg = segments[index]
    if tuple(loaded.shape) != (seg.size, param.shape[2]):
        raise ValueError(
            f"shape {tuple(loaded.shape)} in the checkpoint, expected ({seg.size}, "
            f"{param.shape[2]})"
        )
    rows = loaded.narrow(0, seg.rows.start, len(seg.rows))
    param.data[expert, offsets[index] : offsets[index] + len(seg.rows)].copy_(rows)


def _load_expert_columns(param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
    """param [E, H, cols]: this rank's input columns of every expert's down projection.
    shard_id (expert, 0) loads one checkpoint tensor [H, I]; None the fused [E, H, I]."""
    cols: Segment = param.columns
    if shard_id is None:
        whole = (param.shape[0], param.shape[1], cols.size)
        if tuple(loaded.shape) != whole:
            raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, expected {whole}")
        param.data.copy_(loaded.narrow(2, cols.rows.start, len(cols.rows)))
        return
    expert, _ = shard_id
    if tuple(loaded.shape) != (param.shape[1], cols.size):
        raise ValueError(
            f"shape {tuple(loaded.shape)} in the checkpoint, expected ({param.shape[1]}, "
            f"{cols.size})"
        )
    param.data[expert].copy_(loaded.narrow(1, cols.rows.start, len(cols.rows)))


class FusedExperts(nn.Module):
    """`gate_up_proj` [E, 2I, H] (or `up_proj` [E, I, H]) and `down_proj` [E, H, I], with
    I this rank's share of each expert's intermediate dim."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        gated: bool,
    ) -> None:
        super().__init__()
        channels = Segment.even(intermediate_size, tp)
        if not channels.rows:
            raise ValueError(
                f"tensor_parallel_size = {tp.size} is more than the {intermediate_size} "
                f"intermediate channels of each expert; use at most {intermediate_size}"
            )
        segments = (channels, channels) if gated else (channels,)
        up = nn.Parameter(
            torch.zeros(num_experts, len(channels.rows) * len(segments), hidden_size),
            requires_grad=False,
        )
        up.segments = segments
        up.shard_ids = tuple((e, j) for e in range(num_experts) for j in range(len(segments)))
        up.weight_loader = _load_expert_rows
        down = nn.Parameter(
            torch.zeros(num_experts, hidden_size, len(channels.rows)), requires_grad=False
        )
        down.columns = channels
        down.shard_ids = tuple((e, 0) for e in range(num_experts))
        down.weight_loader = _load_expert_columns
        self.gated = gated
        if gated:
            self.gate_up_proj = up
        else:
            self.up_proj = up
        self.down_proj = down

    def up_weight(self) -> torch.Tensor:
        return self.gate_up_proj if self.gated else self.up_proj


class Router(nn.Module):
    """`weight` [E, H] (replicated), and `e_score_correction_bias` [E] where the family
    has one, kept in float32 whatever the model dtype (as checkpoints store it): its
    small differences decide close choices between experts."""

    def __init__(self, num_experts: int, hidden_size: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = replicated_parameter(num_experts, hidden_size)
        self.e_score_correction_bias = None
        if correction_bias:
            bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            bias.weight_loader = load_replicated
            self.e_score_correction_bias = bias


class FusedMoE(nn.Module):
    """router -> top-k experts -> fused expert MLPs (+ shared experts) -> all-reduce.

    `router_in_float32` computes the router logits from float32 inputs and weight
    (Nemotron-H); otherwise they are computed in the model dtype and scored in float32.
    `shared_intermediate_size` > 0 adds `shared_experts`, an MLP every token goes
    through (gated like the experts, with biases when `shared_bias`). `latent_size` > 0
    runs the routed experts in that smaller space: `fc1_latent_proj` maps the input into
    it and `fc2_latent_proj` maps the experts' weighted sum back (both replicated, with
    biases when `latent_bias`); the router and the shared experts see the input as it is.
    `reduce_results=False` returns this rank's partial sum, for a caller that adds other
    partial sums before one all-reduce.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        routing: Routing,
        ops: KernelOps,
        tp: TensorParallel,
        activation: str = "silu",
        gated: bool = True,
        correction_bias: bool = False,
        router_in_float32: bool = False,
        shared_intermediate_size: int = 0,
        shared_bias: bool = False,
        latent_size: int = 0,
        latent_bias: bool = False,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"this checkpoint's expert activation ({activation!r}) is not supported; "
                f"the MoE kernels apply {', '.join(sorted(ACTIVATIONS))}"
            )
        routing.check(num_experts)
        self.routing, self.ops, self.tp = routing, ops, tp
        self._routing_kw = dataclasses.asdict(routing)
        self.activation, self.gated = activation, gated
        self.router_in_float32 = router_in_float32
        self.reduce_results = reduce_results
        self.router = Router(num_experts, hidden_size, correction_bias)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent_size:
            self.fc1_latent_proj = ReplicatedLinear(hidden_size, latent_size, latent_bias)
            self.fc2_latent_proj = ReplicatedLinear(latent_size, hidden_size, latent_bias)
        expert_size = latent_size or hidden_size
        self.experts = FusedExperts(num_experts, expert_size, intermediate_size, tp, gated)
        self.shared_experts = None
        if shared_intermediate_size:
            args = (hidden_size, shared_intermediate_size, tp, activation)
            kw = {"bias": shared_bias, "reduce_results": False}
            # Gated: act(gate) * up as the kernel set's fused op, as in the dense layers.
            self.shared_experts = GatedMLP(*args, **kw, ops=ops) if gated else MLP(*args, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_in_float32:
            logits = F.linear(x.float(), self.router.weight.float())
        else:
            logits = F.linear(x, self.router.weight)
        weights, ids = self.ops.moe_route(
            logits, self.router.e_score_correction_bias, **self._routing_kw
        )
        routed_in = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        y = self.ops.fused_moe(
            routed_in,
            self.experts.up_weight(),
            self.experts.down_proj,
            weights,
            ids,
            activation=self.activation,
            gated=self.gated,
        )
        if self.fc2_latent_proj is not None:
            # Linear, so it maps this rank's partial sum; the bias is added once (rank 0).
            proj = self.fc2_latent_proj
            y = F.linear(y, proj.weight, proj.bias if self.tp.rank == 0 else None)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return self.tp.all_reduce(y) if self.reduce_results else y


# (checkpoint projection name, fused parameter name, segment)
ExpertNameRule = tuple[str, str, int]
GATED_EXPERT_NAMES: tuple[ExpertNameRule, ...] = (
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
    ("down_proj", "down_proj", 0),
)
PLAIN_EXPERT_NAMES: tuple[ExpertNameRule, ...] = (
    ("up_proj", "up_proj", 0),
    ("down_proj", "down_proj", 0),
)
_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


class ExpertCheckpointNames:
    """Mixin for a CausalLM whose checkpoint stores each expert's projections as their
    own tensors: `<prefix>.experts.N.gate_proj.weight` loads into the fused parameter
    `<prefix>.experts.gate_up_proj` as shard (N, 0), `up_proj` as (N, 1), and so on by
    `expert_name_rules`. Other names go through the family's `name_rules`."""

    expert_name_rules: tuple[ExpertNameRule, ...] = GATED_EXPERT_NAMES

    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        match = _EXPERT_KEY.search(name)
        if match:
            for projection, fused, segment in self.expert_name_rules:
                if match.group(2) == projection:
                    return f"{name[: match.start()]}.experts.{fused}", (
                        int(match.group(1)),
                        segment,
                    )
        return super().checkpoint_to_param(name)

    def param_to_checkpoint(self, name: str, shard: object) -> str:
        if isinstance(shard, tuple):
            prefix, leaf = name.rsplit(".", 1)
            expert, segment = shard
            for projection, fused, rule_segment in self.expert_name_rules:
                if leaf == fused and rule_segment == segment:
                    return f"{prefix}.{expert}.{projection}.weight"
        return super().param_to_checkpoint(name, shard)
