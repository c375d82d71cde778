"""Mamba1 mixer (selective scan), with FalconMamba's weightless norms on B, C and dt."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch
from ssmserve.layers.norm import rms_normalize


class MambaMixer(nn.Module):
    """Parameter names follow HF (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        time_step_rank: int,
        ops: KernelOps,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        bcdt_rms_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.state_size = state_size
        self.conv_kernel = conv_kernel
        self.time_step_rank = time_step_rank
        self.bcdt_rms_eps = bcdt_rms_eps  # FalconMamba: normalise B, C, dt
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=use_bias)
        self.conv1d = nn.Conv1d(
            intermediate_size,
            intermediate_size,
            conv_kernel,
            groups=intermediate_size,
            bias=use_conv_bias,
        )
        self.x_proj = nn.Linear(intermediate_size, time_step_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(time_step_rank, intermediate_size, bias=True)
        self.A_log = nn.Parameter(torch.zeros(intermediate_size, state_size))
        self.D = nn.Parameter(torch.ones(intermediate_size))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=use_bias)
        self.ops = ops
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def cache_bytes_per_slot(self, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        conv = self.intermediate_size * (self.conv_kernel - 1)
        ssm = self.intermediate_size * self.state_size
        return (
            conv * torch.empty((), dtype=dtype).element_size()
            + ssm * torch.empty((), dtype=state_dtype).element_size()
        )

    def allocate_cache(
        self, num_slots: int, dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device
    ) -> None:
        self.conv_state = torch.zeros(
            num_slots, self.intermediate_size, self.conv_kernel - 1, dtype=dtype, device=device
        )
        self.ssm_state = torch.zeros(
            num_slots, self.intermediate_size, self.state_size, dtype=state_dtype, device=device
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        Dm, N = self.intermediate_size, self.state_size
        nd = batch.num_decodes
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        conv_weight = self.conv1d.weight.view(Dm, self.conv_kernel)
        A = -torch.exp(self.A_log.float())
        dt_bias = self.dt_proj.bias.float()
        pieces = []
        if nd > 0:
            slots = batch.state_slots[:nd]
            u = self.ops.causal_conv1d_update(
                xs[:nd],
                self.conv_state,
                conv_weight,
                self.conv1d.bias,
                state_slots=slots,
                activation="silu",
            )
            dt, B, C = self._ssm_inputs(u)
            y = self.ops.selective_state_update(
                self.ssm_state.view(-1, Dm, 1, N),
                u.view(nd, Dm, 1),
                dt.view(nd, Dm, 1),
                A.view(Dm, 1, N),
                B.view(nd, 1, N),
                C.view(nd, 1, N),
                self.D.view(Dm, 1),
                z[:nd].reshape(nd, Dm, 1),
                dt_bias=dt_bias.view(Dm, 1),
                dt_softplus=True,
                state_slots=slots,
            )
            pieces.append(y.view(nd, Dm))
        if x.shape[0] > nd:
            slots = batch.state_slots[nd:]
            has_init = batch.has_initial_state[nd:]
            cu = batch.query_start_loc_p
            u = self.ops.causal_conv1d_varlen(
                xs[nd:],
                conv_weight,
                self.conv1d.bias,
                conv_state=self.conv_state,
                cu_seqlens=cu,
                state_slots=slots,
                has_initial_state=has_init,
                activation="silu",
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
                    ssm_state=self.ssm_state,
                    state_slots=slots,
                    has_initial_state=has_init,
                    z=z[nd:],
                    delta_bias=dt_bias,
                    delta_softplus=True,
                )
            )
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
        return self.out_proj(y.to(x.dtype))

    def _ssm_inputs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt (before bias and softplus), B, C for each token: [T, Dm], [T, N], [T, N]."""
        dt, B, C = self.x_proj(u).split(
            [self.time_step_rank, self.state_size, self.state_size], dim=-1
        )
        if self.bcdt_rms_eps is not None:
            dt = rms_normalize(dt, self.bcdt_rms_eps)
            B = rms_normalize(B, self.bcdt_rms_eps)
            C = rms_normalize(C, self.bcdt_rms_eps)
        return dt @ self.dt_proj.weight.t(), B, C
