"""RMSNorm as the checkpoints define it: float32 statistics, weight applied in the model dtype."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ssmserve.kernels import KernelOps


class RMSNorm(nn.Module):
    """With `ops`, the kernel set's RMSNorm (gated_rms_norm without a gate: one kernel on
    the GPU); without, the PyTorch expression below. Both round as transformers does.

    `decode_add_norm_gemv`, where the model runner sets one (decode with PDL), takes one
    row's residual add, this norm and the linear it feeds in one launch (`add_norm_gemv`:
    `add_forward_linear`)."""

    decode_add_norm_gemv: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: KernelOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dtype == torch.promote_types(x.dtype, self.weight.dtype):
            return self.ops.gated_rms_norm(x, self.weight, eps=self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of s, s) for s = residual + x: with `ops` and one dtype throughout,
        one kernel for the residual add and the norm (`add_rms_norm`, the same roundings
        as the add followed by `forward`)."""
        if self.ops is not None and x.dtype == residual.dtype == self.weight.dtype:
            return self.ops.add_rms_norm(x, residual, self.weight, eps=self.eps)
        s = residual + x
        return self(s), s

    def add_forward_linear(
        self, x: torch.Tensor, residual: torch.Tensor, linear: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(n), s) for (n, s) = add_forward(x, residual), where `linear` (a
        column-parallel linear: every rank has the whole input) is what the norm's output
        feeds, and only it. One launch for one row with `decode_add_norm_gemv` (its
        roundings are add_forward's kernel's, so one dtype throughout)."""
        fused = self.decode_add_norm_gemv
        if fused is not None and x.shape[0] == 1:
            if x.dtype == residual.dtype == self.weight.dtype:
                return fused(x, residual, self.weight, linear.weight, linear.bias, eps=self.eps)
        h, s = self.add_forward(x, residual)
        return linear(h), s
