"""Gated activation: act(gate) * up, from one [T, 2I] matrix holding gate then up.

The activation is rounded to the input dtype before the product, as `act(gate) * up`
in the model dtype does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    check_shape,
    device_function,
    gdc_launch_dependents,
    gdc_wait,
    lazy_jit,
    next_pow2,
    pdl_launch,
    tl,
)

ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")


def _check_act_args(gate_up: torch.Tensor, act: str) -> tuple[int, int]:
    if act not in ACTIVATIONS:
        raise ValueError(f"act_and_mul supports {ACTIVATIONS}, got {act!r}")
    check_shape("gate_up", gate_up, [None, None])
    T, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {width}")
    return T, width // 2


def _act_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    if act in ("silu", "swish"):
        return F.silu(x)
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


def act_and_mul_ref(gate_up: torch.Tensor, *, act: str, pdl: bool = False) -> torch.Tensor:
    """gate_up [T, 2I] -> act(gate_up[:, :I]) * gate_up[:, I:], [T, I] in its dtype."""
    _, inter = _check_act_args(gate_up, act)
    gate, up = gate_up.split([inter, inter], dim=-1)
    return _act_ref(gate, act) * up


# ---------------------------------------------------------------------------- Triton


@device_function
def act_and_mul_tile(g, u, ACT: tl.constexpr):
    """act(g) * u for tiles g and u in the output dtype: float32 arithmetic, the
    activation rounded to that dtype before the product (ACT: an `ACT_CODES` value)."""
    gf = g.to(tl.float32)
    if ACT == 0:  # silu
        a = gf / (1.0 + tl.exp(-gf))
    elif ACT == 1:  # gelu (erf)
        a = 0.5 * gf * (1.0 + tl.erf(gf * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation
        inner = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
        a = 0.5 * gf * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    else:  # relu
        a = tl.maximum(gf, 0.0)
    return (a.to(g.dtype).to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@lazy_jit
def _act_and_mul_kernel(
    x_ptr,
    y_ptr,
    inter,
    stride_x,
    stride_y,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + offs, act_and_mul_tile(g, u, ACT), mask=mask)


ACT_CODES = {"silu": 0, "swish": 0, "gelu": 1, "gelu_pytorch_tanh": 2, "relu": 3}


def act_and_mul_triton(gate_up: torch.Tensor, *, act: str, pdl: bool = False) -> torch.Tensor:
    """Triton twin of `act_and_mul_ref` (same arguments, shapes and result)."""
    T, inter = _check_act_args(gate_up, act)
    y = torch.empty((T, inter), dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return y
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    block = min(next_pow2(inter), 2048)
    _act_and_mul_kernel[(T, math.ceil(inter / block))](
        gate_up,
        y,
        inter,
        gate_up.stride(0),
        y.stride(0),
        ACT=ACT_CODES[act],
        BLOCK=block,
        PDL=pdl,
        **pdl_launch(pdl),
    )
    return y
