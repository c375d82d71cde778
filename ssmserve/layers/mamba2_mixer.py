"""Mamba2 mixer (SSD): in_proj -> causal conv -> chunked scan -> gated RMSNorm -> out_proj.

Tensor parallelism splits heads (z, x, dt, A, D, dt_bias, the norm weight and out_proj's
input by heads) and gives each rank the B/C groups its heads read. When a rank's heads
read their groups unevenly (n_groups not dividing by the TP size, e.g. 3 groups over 2
ranks), the rank holds one copy of the group per head instead, so every n_groups works
at every TP size. The gated RMSNorm is exact under TP: where a normalisation group spans
ranks, the sums of squares are all-reduced. Without the norm (`gated_norm=False`, some
Falcon-H1 checkpoints) the scan output is only gated by silu(z).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ssmserve.distributed.parallel import TensorParallel, shard_range
from ssmserve.kernels import KernelOps
from ssmserve.kernels.mamba2_decode import conv_then_state_update
from ssmserve.kernels.ssd_scan import chunk_tokens
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.cache import (
    SSMState,
    StateSpec,
    decode_rounding,
    scan_snapshot_args,
    snapshot_conv_states,
)
from ssmserve.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    Segment,
    head_segment,
    row_sharded_parameter,
)

# Decode steps of at most this many sequences run the conv and state update as one fused
# launch (`mamba2_decode_update`), larger ones as the two launches: on the H200 the fused
# kernel is faster at one sequence and slower from two on (docs/kernels.md, "Fused Mamba2
# decode"). Both give the same result (exactly so through the PyTorch twins).
FUSED_DECODE_MAX_ROWS = 1

# HF activation names the conv kernels apply (they implement SiLU).
CONV_ACTIVATIONS = {"silu": "silu", "swish": "silu"}


def conv_activation(hidden_act: str) -> str:
    """The conv kernels' name for an HF `hidden_act`, or a clear error."""
    if hidden_act not in CONV_ACTIVATIONS:
        raise ValueError(
            f"this checkpoint's SSM activation (hidden_act = {hidden_act!r}) is not supported; "
            f"the conv kernels apply {', '.join(sorted(CONV_ACTIVATIONS))}"
        )
    return CONV_ACTIVATIONS[hidden_act]


@dataclass(frozen=True)
class Mamba2Shard:
    """Which heads and B/C groups one rank holds."""

    heads: range
    groups: tuple[int, ...]  # global group id of each local group, in order

    @classmethod
    def plan(cls, num_heads: int, n_groups: int, tp: TensorParallel) -> Mamba2Shard:
        if num_heads % n_groups:
            raise ValueError(f"num_heads = {num_heads} must be a multiple of n_groups = {n_groups}")
        heads = shard_range(num_heads, tp.size, tp.rank)
        if not heads:
            raise ValueError(
                f"tensor_parallel_size = {tp.size} is more than the {num_heads} SSM heads; "
                f"use at most {num_heads}"
            )
        per_group = num_heads // n_groups
        of_head = [h // per_group for h in heads]
        distinct = sorted(set(of_head))
        even = all(of_head.count(g) == len(heads) // len(distinct) for g in distinct)
        even = even and len(heads) % len(distinct) == 0
        return cls(heads, tuple(distinct) if even else tuple(of_head))


class Mamba2Mixer(nn.Module):
    """Parameter names follow HF (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).

    Decode sequences (the batch's first `num_decodes`) take the one-token conv and state
    update (one fused launch for up to FUSED_DECODE_MAX_ROWS of them); the rest go
    through the varlen conv and SSD scan, resuming from their state slot where
    `has_initial_state`. States are read and written by slot, in place; the batch's
    snapshots (prefix caching) also write conv and SSM states at chunk boundaries into
    checkpoint rows.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int,
        conv_kernel: int,
        chunk_size: int,
        norm_eps: float,
        ops: KernelOps,
        tp: TensorParallel,
        activation: str = "silu",
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        use_bias: bool = False,
        use_conv_bias: bool = True,
        norm_group_size: int | None = None,
        norm_before_gate: bool = False,
        gated_norm: bool = True,
        out_proj_bias: bool | None = None,
        in_proj_multipliers: Sequence[float] | None = None,
    ) -> None:
        """`out_proj_bias` defaults to `use_bias`. `in_proj_multipliers` scale in_proj's
        five output segments (z, x, B, C, dt) after the projection (Falcon-H1's µP vector)."""
        super().__init__()
        self.tp, self.ops = tp, ops
        self.activation = conv_activation(activation)
        shard = Mamba2Shard.plan(num_heads, n_groups, tp)
        H, P, N = len(shard.heads), head_dim, state_size
        self.num_heads, self.head_dim, self.state_size = H, P, N
        self.n_groups = len(shard.groups)
        self.intermediate_size = H * P
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * N
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.norm_eps, self.norm_before_gate = norm_eps, norm_before_gate
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))

        inner = head_segment(shard.heads, P, num_heads)
        groups = Segment.units(shard.groups, N, n_groups)
        per_head = Segment.units(shard.heads, 1, num_heads)
        self.in_proj = ColumnParallelLinear(
            hidden_size, [inner, inner, groups, groups, per_head], use_bias
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = row_sharded_parameter([inner, groups, groups], 1, conv_kernel)
        self.conv1d.bias = row_sharded_parameter([inner, groups, groups]) if use_conv_bias else None
        self.dt_bias = row_sharded_parameter([per_head], fill=1.0)
        self.A_log = row_sharded_parameter([per_head])
        self._A: torch.Tensor | None = None  # -exp(A_log), see _decay_rates
        self.D = row_sharded_parameter([per_head], fill=1.0)
        self.norm = None
        if gated_norm:
            self.norm = nn.Module()
            self.norm.weight = row_sharded_parameter([inner], fill=1.0)
            self._plan_norm(num_heads * P, norm_group_size or num_heads * P, shard.heads.start * P)
        out_bias = use_bias if out_proj_bias is None else out_proj_bias
        self.out_proj = RowParallelLinear(num_heads * P, hidden_size, tp, out_bias, columns=inner)
        scale = None
        if in_proj_multipliers is not None:
            if len(in_proj_multipliers) != 5:
                raise ValueError(
                    f"in_proj_multipliers has {len(in_proj_multipliers)} values; it needs one "
                    "per in_proj segment (z, x, B, C, dt)"
                )
            sizes = self.in_proj.output_sizes
            scale = torch.cat(
                [
                    torch.full((n,), float(m), device="cpu")
                    for n, m in zip(sizes, in_proj_multipliers)
                ]
            )
        self.register_buffer("in_proj_scale", scale, persistent=False)

    def _plan_norm(self, full_size: int, group: int, first_channel: int) -> None:
        """Normalise locally when this rank's channels cover whole norm groups; otherwise
        map each local channel to its global group for the all-reduced path."""
        if full_size % group:
            raise ValueError(f"the gated norm's group size {group} must divide {full_size}")
        last = first_channel + self.intermediate_size
        self.norm_group_size = group
        self.norm_local = first_channel % group == 0 and last % group == 0
        self.num_norm_groups = full_size // group
        # NOTE: computed buffers are made on the CPU (whatever device the model is built
        # on, `meta` included) and moved with the model; see ModelRunner.
        channels = torch.arange(first_channel, last, device="cpu")
        self.register_buffer("norm_group_of_channel", channels // group, persistent=False)

    def cache_spec(self) -> StateSpec:
        return StateSpec(
            (self.conv_dim, self.conv_kernel - 1),
            (self.num_heads, self.head_dim, self.state_size),
            snapshot_multiple=chunk_tokens(self.chunk_size),
        )

    def _decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) in float32, made at the first forward (after the weights are
        loaded) and kept: not two kernels per layer in every step."""
        if self._A is None:
            self._A = -torch.exp(self.A_log.float())
        return self._A

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: SSMState) -> torch.Tensor:
        H, P, N, G = self.num_heads, self.head_dim, self.state_size, self.n_groups
        I = self.intermediate_size  # noqa: E741
        nd = batch.num_decodes
        zxbcdt = self.in_proj(x)
        if self.in_proj_scale is not None:
            zxbcdt = zxbcdt * self.in_proj_scale
        z, xbc, dt = zxbcdt.split([I, self.conv_dim, H], dim=-1)
        A = self._decay_rates()
        conv_weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        outs = []
        if nd > 0:
            decode_update = self.ops.mamba2_decode_update
            if nd > FUSED_DECODE_MAX_ROWS:
                decode_update = functools.partial(
                    conv_then_state_update,
                    self.ops.causal_conv1d_update,
                    self.ops.selective_state_update,
                )
            y_d = decode_update(
                xbc[:nd],
                cache.conv,
                conv_weight,
                self.conv1d.bias,
                cache.ssm,
                dt[:nd],
                A,
                self.D,
                dt_bias=self.dt_bias,
                dt_softplus=True,
                dt_limit=self.time_step_limit,
                n_groups=G,
                activation=self.activation,
                state_slots=batch.state_slots[:nd],
                **decode_rounding(batch, cache),
            )
            outs.append(y_d.reshape(nd, I))
        num_prefill_tokens = x.shape[0] - nd
        if num_prefill_tokens > 0:
            slots = batch.state_slots[nd:]
            has_init = batch.has_initial_state[nd:]
            cu = batch.query_start_loc_p
            snaps = batch.snapshots_p
            if snaps is not None:
                sources = batch.conv_snapshots(cache.conv.shape[2])
                snapshot_conv_states(xbc[nd:], cache.conv, sources)
            xbc_p = self.ops.causal_conv1d_varlen(
                xbc[nd:],
                conv_weight,
                self.conv1d.bias,
                conv_state=cache.conv,
                cu_seqlens=cu,
                state_slots=slots,
                has_initial_state=has_init,
                activation=self.activation,
            )
            xs, B, C = xbc_p.split([I, G * N, G * N], dim=-1)
            outs.append(
                self.ops.ssd_scan_varlen(
                    xs.reshape(num_prefill_tokens, H, P),
                    dt[nd:],
                    A,
                    B.reshape(num_prefill_tokens, G, N),
                    C.reshape(num_prefill_tokens, G, N),
                    self.D,
                    cu_seqlens=cu,
                    ssm_state=cache.ssm,
                    state_slots=slots,
                    has_initial_state=has_init,
                    dt_bias=self.dt_bias,
                    dt_softplus=True,
                    dt_limit=self.time_step_limit,
                    chunk_size=self.chunk_size,
                    # Chunks stay aligned however a prompt was split across steps.
                    start_positions=batch.start_positions_p,
                    **scan_snapshot_args(snaps),
                ).reshape(num_prefill_tokens, I)
            )
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.out_proj(self._gated_norm(y, z).to(x.dtype))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return y * F.silu(z)
        if self.norm_local:
            group = self.norm_group_size
            return self.ops.gated_rms_norm(
                y,
                self.norm.weight,
                z,
                eps=self.norm_eps,
                group_size=None if group == self.intermediate_size else group,
                norm_before_gate=self.norm_before_gate,
            )
        # A normalisation group spans ranks: sum each group's squares over the ranks.
        gate = F.silu(z.float())
        h = y.float() if self.norm_before_gate else y.float() * gate
        sums = h.new_zeros(h.shape[0], self.num_norm_groups)
        sums.index_add_(1, self.norm_group_of_channel, h.pow(2))
        rstd = torch.rsqrt(self.tp.all_reduce(sums) / self.norm_group_size + self.norm_eps)
        h = h * rstd[:, self.norm_group_of_channel]
        if self.norm_before_gate:
            h = h * gate
        return self.norm.weight * h.to(y.dtype)
