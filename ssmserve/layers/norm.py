"""RMSNorm as the checkpoints define it: float32 statistics, weight applied in the model dtype."""

from __future__ import annotations

import torch
from torch import nn

from ssmserve.kernels import KernelOps


class RMSNorm(nn.Module):
    """With `ops`, the kernel set's RMSNorm (gated_rms_norm without a gate: one kernel on
    the GPU); without, the PyTorch expression below. Both round as transformers does."""

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
