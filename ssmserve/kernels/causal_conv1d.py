"""Depthwise causal conv1d for Mamba mixers: varlen prefill and one-token update.

y[t, c] = act(bias[c] + sum_k weight[c, k] * xs[t + k, c]) where xs is the
sequence's input preceded by its K-1 previous inputs (the conv state, oldest first;
zeros without initial state). The conv state of a slot always holds the last K-1
inputs seen by that sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import check_shape, check_varlen

_ACTIVATIONS = (None, "silu", "swish")


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def _check_conv_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> tuple[int, int, int]:
    check_shape("x", x, [None, None])
    T, Cd = x.shape
    check_shape("weight", weight, [Cd, None])
    K = weight.shape[1]
    if K < 2:
        raise ValueError(f"conv kernel width must be >= 2, got {K}")
    if bias is not None:
        check_shape("bias", bias, [Cd])
    check_shape("conv_state", conv_state, [None, Cd, K - 1])
    return T, Cd, K


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Varlen causal depthwise conv1d (prefill) in PyTorch, float32 math.

    Args:
        x: [T, Cd] packed inputs.
        weight: [Cd, K]. bias: [Cd] or None.
        conv_state: [num_slots, Cd, K-1] previous inputs, oldest first; updated in place
            to the last K-1 inputs of (old state ++ sequence), also when the sequence
            is shorter than K-1.
        cu_seqlens: [S+1] int32. state_slots: [S] int. has_initial_state: [S] bool.
        activation: "silu" (or "swish") or None.

    Returns:
        y: [T, Cd] in x.dtype.
    """
    _check_activation(activation)
    T, Cd, K = _check_conv_args(x, weight, bias, conv_state)
    check_shape("state_slots", state_slots, [None])
    seqs = check_varlen(cu_seqlens, state_slots, has_initial_state, T, conv_state.shape[0])
    w = weight.float()[:, None, :]  # [Cd, 1, K] for a grouped conv
    b = bias.float() if bias is not None else None
    y = torch.empty(T, Cd, dtype=torch.float32, device=x.device)
    for start, end, slot, has_init in seqs:
        if has_init:
            context = conv_state[slot].float()
        else:
            context = x.new_zeros(Cd, K - 1, dtype=torch.float32)
        xs = torch.cat([context, x[start:end].float().t()], dim=1)  # [Cd, K-1+L]
        if end > start:
            y[start:end] = F.conv1d(xs[None], w, b, groups=Cd)[0].t()
        conv_state[slot] = xs[:, xs.shape[1] - (K - 1) :].to(conv_state.dtype)
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype)


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token of the causal conv1d, in place on the conv state pool.

    Args:
        x: [Bt, Cd], one token per sequence.
        conv_state: [num_slots, Cd, K-1], updated in place (shifted by one token).
        weight: [Cd, K]. bias: [Cd] or None.
        state_slots: [Bt] int; entries < 0 are padding: state untouched, output 0.
        activation: "silu" (or "swish") or None.

    Returns:
        y: [Bt, Cd] in x.dtype.
    """
    _check_activation(activation)
    Bt, Cd, K = _check_conv_args(x, weight, bias, conv_state)
    check_shape("state_slots", state_slots, [Bt])
    rows = torch.nonzero(state_slots >= 0).squeeze(1)
    slots = state_slots[rows].long()
    xs = torch.cat([conv_state[slots].float(), x[rows].float()[:, :, None]], dim=2)  # [Bv,Cd,K]
    y_v = (xs * weight.float()).sum(-1)
    if bias is not None:
        y_v += bias.float()
    if activation is not None:
        y_v = F.silu(y_v)
    conv_state[slots] = xs[:, :, 1:].to(conv_state.dtype)
    y = torch.zeros(Bt, Cd, dtype=x.dtype, device=x.device)
    y[rows] = y_v.to(x.dtype)
    return y
