"""MLPs: gated (SwiGLU and friends: down(act(gate(x)) * up(x))) and plain (down(act(up(x))))."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import KernelOps
from ssmserve.kernels.activation import ACTIVATIONS
from ssmserve.layers.linear import ColumnParallelLinear, RowParallelLinear, Segment


class GatedMLP(nn.Module):
    """gate and up fused in one column-parallel matrix (shards 0 and 1), down row-parallel
    (`reduce_results=False`: this rank's partial sum, see RowParallelLinear).

    For one row, `decode_gemv_act_and_mul` (where the model runner set one: batch-1
    decode with PDL) computes the gate_up projection and act(gate) * up in one launch."""

    decode_gemv_act_and_mul: Callable[..., torch.Tensor] | None = None

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        act: str = "silu",
        bias: bool = False,
        reduce_results: bool = True,
        ops: KernelOps | None = None,
    ) -> None:
        super().__init__()
        # With `ops`, act(gate) * up is one fused op (the activations it knows).
        self.fused_act = ops.act_and_mul if ops is not None and act in ACTIVATIONS else None
        self.act_name = act
        self.gate_up_proj = ColumnParallelLinear.even(
            hidden_size, [intermediate_size, intermediate_size], tp, bias
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            tp,
            bias,
            columns=Segment.even(intermediate_size, tp),
            reduce_results=reduce_results,
        )
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor, gate_up_delta: torch.Tensor | None = None) -> torch.Tensor:
        """`gate_up_delta` (this rank's gate and up columns) is added to the fused
        projection: a per-use adapter's output (Zamba2's LoRA)."""
        fused, weight = self.decode_gemv_act_and_mul, self.gate_up_proj.weight
        if (
            fused is not None
            and self.fused_act is not None
            and gate_up_delta is None
            and x.dim() == 2
            and x.shape[0] == 1
            and weight.stride(1) == 1
        ):
            gated = fused(x, weight, self.gate_up_proj.bias, act=self.act_name)
            return self.down_proj(gated)
        gate_up = self.gate_up_proj(x)
        if gate_up_delta is not None:
            gate_up = gate_up + gate_up_delta
        if self.fused_act is not None:
            return self.down_proj(self.fused_act(gate_up, act=self.act_name))
        gate, up = gate_up.split(self.gate_up_proj.output_sizes, dim=-1)
        return self.down_proj(self.act(gate) * up)


class MLP(nn.Module):
    """up -> act -> down (Nemotron-H's squared-ReLU MLP)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        act: str,
        bias: bool = False,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear.even(hidden_size, [intermediate_size], tp, bias)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp, bias, reduce_results=reduce_results
        )
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
