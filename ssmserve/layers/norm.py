"""RMSNorm as the checkpoints define it: float32 statistics, weight applied in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class AddNorm:
    """The RMSNorm of `residual + x` as a linear's input (an `InputNorm` of x, the block
    output before it): the first linear that reads it computes it, inside its one-row
    GEMV where it runs one (batch-1 decode: the add and the norm then cost no kernel of
    their own), and from then on `sum` is the residual stream after the add.

    Rounded as `add_rms_norm` (the sum in the residual's dtype, normalised in the norm
    weight's), which with one dtype throughout is `RMSNorm.add_forward`."""

    def __init__(self, norm: RMSNorm, residual: torch.Tensor) -> None:
        self.norm = norm
        self.residual = residual
        self._sum: torch.Tensor | None = None

    @property
    def sum(self) -> torch.Tensor:
        if self._sum is None:
            raise RuntimeError("AddNorm.sum is read before a linear computed the norm")
        return self._sum

    def _fusable(self, x: torch.Tensor) -> bool:
        return self.norm.ops is not None and x.dtype == self.norm.weight.dtype

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusable(x):
            h, self._sum = self.norm.ops.add_rms_norm(
                x, self.residual, self.norm.weight, eps=self.norm.eps
            )
        else:
            h, self._sum = self.norm.add_forward(x, self.residual)
        return h

    def gemv(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not self._fusable(x):
            return F.linear(self.apply(x), weight, bias)
        y, self._sum = self.norm.ops.add_rms_norm_gemv(
            x, weight, bias, residual=self.residual, norm_weight=self.norm.weight,
            eps=self.norm.eps,
        )  # fmt: skip
        return y
