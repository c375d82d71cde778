"""Mamba2 mixer (SSD): in_proj -> causal conv -> chunked scan -> gated RMSNorm -> out_proj."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.kernels import KernelOps
from ssmserve.layers.batch import ForwardBatch


class Mamba2Mixer(nn.Module):
    """Parameter names follow HF (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).

    Decode sequences (the batch's first `num_decodes`) take the one-token conv and state
    updates; the rest go through the varlen conv and SSD scan, resuming from their state
    slot where `has_initial_state`. States are read and written by slot, in place.
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
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        use_bias: bool = False,
        use_conv_bias: bool = True,
        norm_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.state_size, self.n_groups = state_size, n_groups
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.norm_eps = norm_eps
        self.norm_group_size = norm_group_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)
        self.ops = ops
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def cache_bytes_per_slot(self, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        ssm = self.num_heads * self.head_dim * self.state_size
        return conv + ssm * torch.empty((), dtype=state_dtype).element_size()

    def allocate_cache(
        self, num_slots: int, dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device
    ) -> None:
        self.conv_state = torch.zeros(
            num_slots, self.conv_dim, self.conv_kernel - 1, dtype=dtype, device=device
        )
        self.ssm_state = torch.zeros(
            num_slots,
            self.num_heads,
            self.head_dim,
            self.state_size,
            dtype=state_dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        H, P, N, G = self.num_heads, self.head_dim, self.state_size, self.n_groups
        I = self.intermediate_size  # noqa: E741
        nd = batch.num_decodes
        z, xbc, dt = self.in_proj(x).split([I, self.conv_dim, H], dim=-1)
        A = -torch.exp(self.A_log.float())
        conv_weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        outs = []
        if nd > 0:
            slots = batch.state_slots[:nd]
            xbc_d = self.ops.causal_conv1d_update(
                xbc[:nd],
                self.conv_state,
                conv_weight,
                self.conv1d.bias,
                state_slots=slots,
                activation="silu",
            )
            xs, B, C = xbc_d.split([I, G * N, G * N], dim=-1)
            outs.append(
                self.ops.selective_state_update(
                    self.ssm_state,
                    xs.view(nd, H, P),
                    dt[:nd, :, None].expand(nd, H, P),
                    A[:, None, None].expand(H, P, N),
                    B.view(nd, G, N),
                    C.view(nd, G, N),
                    self.D[:, None].expand(H, P),
                    dt_bias=self.dt_bias[:, None].expand(H, P),
                    dt_softplus=True,
                    dt_limit=self.time_step_limit,
                    state_slots=slots,
                ).reshape(nd, I)
            )
        num_prefill_tokens = x.shape[0] - nd
        if num_prefill_tokens > 0:
            slots = batch.state_slots[nd:]
            has_init = batch.has_initial_state[nd:]
            cu = batch.query_start_loc_p
            xbc_p = self.ops.causal_conv1d_varlen(
                xbc[nd:],
                conv_weight,
                self.conv1d.bias,
                conv_state=self.conv_state,
                cu_seqlens=cu,
                state_slots=slots,
                has_initial_state=has_init,
                activation="silu",
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
                    ssm_state=self.ssm_state,
                    state_slots=slots,
                    has_initial_state=has_init,
                    dt_bias=self.dt_bias,
                    dt_softplus=True,
                    dt_limit=self.time_step_limit,
                    chunk_size=self.chunk_size,
                    # Chunks stay aligned however a prompt was split across steps.
                    start_positions=batch.start_positions_p,
                ).reshape(num_prefill_tokens, I)
            )
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        y = self.ops.gated_rms_norm(
            y, self.norm.weight, z, eps=self.norm_eps, group_size=self.norm_group_size
        )
        return self.out_proj(y.to(x.dtype))
