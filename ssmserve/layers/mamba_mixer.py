"""Mamba1 mixer (selective scan), with RMS norms on dt, B and C: weightless (FalconMamba)
or with weights (Jamba)."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import KernelOps
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
    linear,
    row_sharded_parameter,
)
from ssmserve.layers.mamba2_mixer import conv_activation
from ssmserve.layers.norm import RMSNorm

# Decode steps of at most this many sequences run dt_proj inside the state update (each
# program reads its channels' rows of the weight, so more rows read it more times): one
# launch fewer a layer at batch 1 (with the conv update's smaller tile, Mamba-2.8B's token
# 2.60 ms against 2.93 on an H100; docs/kernels.md, "Selective state update").
FUSED_DT_PROJ_MAX_ROWS = 1


class MambaMixer(nn.Module):
    """Parameter names follow HF (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj).

    Tensor parallelism splits the inner channels (any split: channels are independent);
    x_proj is row-parallel, so every rank gets the whole dt, B and C after its all-reduce
    (and the dt/B/C norms are replicated).

    `bcdt_rms_eps` normalises dt, B and C (before dt_proj); with `bcdt_norm_weights` the
    norms have weights, named as in HF's Jamba (dt_layernorm, b_layernorm, c_layernorm).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        ops: KernelOps,
        tp: TensorParallel,
        activation: str = "silu",
        use_bias: bool = False,
        use_conv_bias: bool = True,
        bcdt_rms_eps: float | None = None,
        bcdt_norm_weights: bool = False,
    ) -> None:
        super().__init__()
        self.tp, self.ops = tp, ops
        self.activation = conv_activation(activation)
        channels = Segment.even(intermediate_size, tp)
        if not channels.rows:
            raise ValueError(
                f"tensor_parallel_size = {tp.size} is more than the {intermediate_size} SSM "
                f"channels; use at most {intermediate_size}"
            )
        self.intermediate_size = len(channels.rows)
        self.state_size = state_size
        self.conv_kernel = conv_kernel
        self.time_step_rank = time_step_rank
        self.bcdt_rms_eps = bcdt_rms_eps
        self.bcdt_norm_weights = bcdt_norm_weights
        if bcdt_norm_weights:
            if bcdt_rms_eps is None:
                raise ValueError("weighted dt/B/C norms need their epsilon (bcdt_rms_eps)")
            self.dt_layernorm = RMSNorm(time_step_rank, bcdt_rms_eps, ops=ops)
            self.b_layernorm = RMSNorm(state_size, bcdt_rms_eps, ops=ops)
            self.c_layernorm = RMSNorm(state_size, bcdt_rms_eps, ops=ops)
        elif bcdt_rms_eps is not None:
            # Weightless norms (FalconMamba) run as the norm op with unit weights: one
            # kernel each, where the PyTorch expression is six. Made on the CPU (buffers
            # are moved to the model's device with the weights).
            self.register_buffer("_unit_dt", torch.ones(time_step_rank, device="cpu"), False)
            self.register_buffer("_unit_bc", torch.ones(state_size, device="cpu"), False)
        self.in_proj = ColumnParallelLinear(hidden_size, [channels, channels], use_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = row_sharded_parameter([channels], 1, conv_kernel)
        self.conv1d.bias = row_sharded_parameter([channels]) if use_conv_bias else None
        self.x_proj = RowParallelLinear(
            intermediate_size, time_step_rank + 2 * state_size, tp, columns=channels
        )
        self.dt_proj = ColumnParallelLinear(time_step_rank, [channels], bias=True)
        self.A_log = row_sharded_parameter([channels], state_size)
        self._A: torch.Tensor | None = None  # -exp(A_log), see _decay_rates
        self._dt_bias: torch.Tensor | None = None
        self.D = row_sharded_parameter([channels], fill=1.0)
        self.out_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp, use_bias, columns=channels
        )

    def cache_spec(self) -> StateSpec:
        return StateSpec(
            (self.intermediate_size, self.conv_kernel - 1),
            (self.intermediate_size, self.state_size),
        )

    def _decay_rates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A = -exp(A_log) and the dt bias, in float32, made at the first forward (after
        the weights are loaded) and kept: not three kernels per layer in every step."""
        if self._A is None:
            self._A = -torch.exp(self.A_log.float())
            self._dt_bias = self.dt_proj.bias.float()
        return self._A, self._dt_bias

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: SSMState) -> torch.Tensor:
        Dm, N = self.intermediate_size, self.state_size
        nd = batch.num_decodes
        xs, z = self.in_proj(x).split([Dm, Dm], dim=-1)
        conv_weight = self.conv1d.weight.view(Dm, self.conv_kernel)
        A, dt_bias = self._decay_rates()
        pieces = []
        if nd > 0:
            slots = batch.state_slots[:nd]
            u = self.ops.causal_conv1d_update(
                xs[:nd],
                cache.conv,
                conv_weight,
                self.conv1d.bias,
                state_slots=slots,
                activation=self.activation,
            )
            # One row: dt_proj inside the state update (one launch fewer a layer).
            fuse_dt = nd <= FUSED_DT_PROJ_MAX_ROWS
            dt, B, C = self._ssm_inputs(u, project_dt=not fuse_dt)
            y = self.ops.selective_state_update(
                cache.ssm.view(-1, Dm, 1, N),
                u.view(nd, Dm, 1),
                dt if fuse_dt else dt.view(nd, Dm, 1),
                A.view(Dm, 1, N),
                B.view(nd, 1, N),
                C.view(nd, 1, N),
                self.D.view(Dm, 1),
                z[:nd].reshape(nd, Dm, 1),
                dt_bias=dt_bias.view(Dm, 1),
                dt_softplus=True,
                state_slots=slots,
                dt_proj_weight=self.dt_proj.weight if fuse_dt else None,
                **decode_rounding(batch, cache),
            )
            pieces.append(y.view(nd, Dm))
        if x.shape[0] > nd:
            slots = batch.state_slots[nd:]
            has_init = batch.has_initial_state[nd:]
            cu = batch.query_start_loc_p
            snaps = batch.snapshots_p
            if snaps is not None:
                sources = batch.conv_snapshots(cache.conv.shape[2])
                snapshot_conv_states(xs[nd:], cache.conv, sources)
            u = self.ops.causal_conv1d_varlen(
                xs[nd:],
                conv_weight,
                self.conv1d.bias,
                conv_state=cache.conv,
                cu_seqlens=cu,
                state_slots=slots,
                has_initial_state=has_init,
                activation=self.activation,
            )
            dt, B, C = self._ssm_inputs(u)
            pieces.append(
                self.ops.selective_scan_varlen(
                    u,
                    dt,
                    A,
                    B,
                    C,
                    self.D,
                    cu_seqlens=cu,
                    ssm_state=cache.ssm,
                    state_slots=slots,
                    has_initial_state=has_init,
                    z=z[nd:],
                    delta_bias=dt_bias,
                    delta_softplus=True,
                    **scan_snapshot_args(snaps),
                )
            )
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return self.out_proj(y.to(x.dtype))

    def _ssm_inputs(
        self, u: torch.Tensor, project_dt: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt (before bias and softplus), B, C for each token: [T, Dm], [T, N], [T, N];
        without `project_dt`, dt before dt_proj: [T, time_step_rank]."""
        dt, B, C = self.x_proj(u).split(
            [self.time_step_rank, self.state_size, self.state_size], dim=-1
        )
        if self.bcdt_norm_weights:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif self.bcdt_rms_eps is not None:
            # x * rsqrt(mean(x^2) + eps) in float32, rounded to x's dtype: a unit weight
            # changes nothing.
            norm, eps = self.ops.gated_rms_norm, self.bcdt_rms_eps
            dt = norm(dt, self._unit_dt, eps=eps)
            B = norm(B, self._unit_bc, eps=eps)
            C = norm(C, self._unit_bc, eps=eps)
        if not project_dt:
            return dt, B, C
        # Through `linear` without the bias (the state update adds it in float32), so
        # that in a batch-1 decode graph dt_proj is a PDL GEMV like the other linears: a
        # cuBLAS launch would break the chain of overlapping launches.
        return linear(dt, self.dt_proj.weight, None, self.dt_proj.decode_gemv), B, C
