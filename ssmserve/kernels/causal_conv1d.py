"""Depthwise causal conv1d for Mamba mixers: varlen prefill and one-token update.

y[t, c] = act(bias[c] + sum_k weight[c, k] * xs[t + k, c]) where xs is the
sequence's input preceded by its K-1 previous inputs (the conv state, oldest first;
zeros without initial state). The conv state of a slot always holds the last K-1
inputs seen by that sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import (
    as_int8,
    cdiv,
    check_shape,
    check_varlen,
    check_varlen_shapes,
    device_function,
    gdc_launch_dependents,
    gdc_wait,
    launch_config,
    lazy_jit,
    next_pow2,
    num_sms,
    pdl_launch,
    tl,
)

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
    pdl: bool = False,
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


# ---------------------------------------------------------------------------- Triton


@lazy_jit(
    do_not_specialize=(
        "cu_seqlens_ptr",
        "state_slots_ptr",
        "has_init_ptr",
        "T",
        "num_seqs",
        "search_steps",
    )
)
def _conv1d_varlen_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    conv_state_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_init_ptr,
    y_ptr,
    T,
    Cd,
    num_seqs,
    search_steps,
    stride_x_t,
    stride_x_c,
    stride_w_c,
    stride_w_k,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    stride_y_t,
    stride_y_c,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Programs tile the packed tokens directly (no per-sequence grid, so no host sync);
    # each token finds its sequence by binary search over cu_seqlens.
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask_c = offs_c < Cd
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_seqs
    # A runtime trip count (bit length of num_seqs): one compiled kernel for every batch.
    for _ in range(search_steps):  # invariant: cu[lo] <= t < cu[hi]
        mid = (lo + hi) // 2
        go_right = tl.load(cu_seqlens_ptr + mid, mask=mask_t, other=0) <= offs_t
        lo = tl.where(go_right & (hi - lo > 1), mid, lo)
        hi = tl.where(~go_right & (hi - lo > 1), mid, hi)
    seq_start = tl.load(cu_seqlens_ptr + lo, mask=mask_t, other=0).to(tl.int64)
    slot = tl.load(state_slots_ptr + lo, mask=mask_t, other=0).to(tl.int64)
    has_init = tl.load(has_init_ptr + lo, mask=mask_t, other=0) != 0

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    # Only a tile whose rows reach back past their sequence's start reads conv states:
    # most tiles of a long prompt take the branch without the state gathers (the state
    # is [slot, channel, k], so its loads along channels are strided and not vectorised).
    reaches_back = tl.min(tl.where(mask_t, offs_t - (K - 1) - seq_start, 0)) < 0
    if reaches_back:
        for k in tl.static_range(K):
            src = offs_t - (K - 1) + k
            in_seq = src >= seq_start
            xv = tl.load(
                x_ptr + src[:, None] * stride_x_t + offs_c[None, :] * stride_x_c,
                mask=(mask_t & in_seq)[:, None] & mask_c[None, :],
                other=0.0,
            ).to(tl.float32)
            # Left context from the slot's conv state (index K-1 + src - start, oldest first).
            sv = tl.load(
                conv_state_ptr
                + slot[:, None] * stride_s_slot
                + offs_c[None, :] * stride_s_c
                + (K - 1 + src - seq_start)[:, None] * stride_s_k,
                mask=(mask_t & ~in_seq & has_init)[:, None] & mask_c[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(weight_ptr + offs_c * stride_w_c + k * stride_w_k, mask=mask_c, other=0.0)
            acc += (xv + sv) * w.to(tl.float32)[None, :]
    else:
        for k in tl.static_range(K):
            src = offs_t - (K - 1) + k
            xv = tl.load(
                x_ptr + src[:, None] * stride_x_t + offs_c[None, :] * stride_x_c,
                mask=mask_t[:, None] & mask_c[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(weight_ptr + offs_c * stride_w_c + k * stride_w_k, mask=mask_c, other=0.0)
            acc += xv * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(
        y_ptr + offs_t[:, None] * stride_y_t + offs_c[None, :] * stride_y_c,
        acc.to(y_ptr.dtype.element_ty),
        mask=mask_t[:, None] & mask_c[None, :],
    )


@lazy_jit(do_not_specialize=("cu_seqlens_ptr", "state_slots_ptr", "has_init_ptr"))
def _conv1d_varlen_state_kernel(
    x_ptr,
    conv_state_ptr,
    cu_seqlens_ptr,
    state_slots_ptr,
    has_init_ptr,
    Cd,
    stride_x_t,
    stride_x_c,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    KM1: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Runs after the conv kernel (which reads the old states): new state = last K-1
    # inputs of (old state ++ sequence).
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < Cd
    start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - start
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    pos = length - KM1 + offs_k  # position in the sequence of new state column k
    mask_k = offs_k < KM1
    from_x = pos >= 0
    state_row = conv_state_ptr + slot * stride_s_slot + offs_c[:, None] * stride_s_c
    xv = tl.load(
        x_ptr + (start + pos)[None, :] * stride_x_t + offs_c[:, None] * stride_x_c,
        mask=mask_c[:, None] & (mask_k & from_x)[None, :],
        other=0.0,
    )
    from_state = mask_k & ~from_x & has_init
    sv = tl.load(
        state_row + (KM1 + pos)[None, :] * stride_s_k,
        mask=mask_c[:, None] & from_state[None, :],
        other=0.0,
    )
    new_state = xv.to(conv_state_ptr.dtype.element_ty) + sv
    # NOTE: columns are read and written by different threads; all reads must land
    # before any write.
    tl.debug_barrier()
    tl.store(
        state_row + offs_k[None, :] * stride_s_k, new_state, mask=mask_c[:, None] & mask_k[None, :]
    )


def varlen_launch_config(Cd: int, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Launch parameters of the varlen conv for `Cd` channels, `config` overriding the
    defaults (benchmarks/kernels/bench_conv1d.py sweeps them).

    block_t, block_c: tokens and channels per program of the conv kernel (the state
        kernel takes block_c channels too).
    num_warps: warps per conv program.
    """
    default = {"block_t": 16, "block_c": min(256, next_pow2(Cd)), "num_warps": 8}
    return launch_config("causal_conv1d_varlen", default, config)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `causal_conv1d_varlen_ref` (same arguments, shapes and result).

    No host sync; cu_seqlens and slot values are not validated. `config` overrides launch
    parameters (see `varlen_launch_config`; benchmarks and tests only).
    """
    _check_activation(activation)
    T, Cd, K = _check_conv_args(x, weight, bias, conv_state)
    S = check_varlen_shapes(cu_seqlens, state_slots, has_initial_state)
    y = torch.empty_like(x)
    if S == 0:
        return y
    has_init = as_int8(has_initial_state)
    cfg = varlen_launch_config(Cd, config)
    block_t, block_c = cfg["block_t"], cfg["block_c"]
    if T > 0:
        grid = (cdiv(T, block_t), cdiv(Cd, block_c))
        _conv1d_varlen_kernel[grid](
            x,
            weight,
            bias,
            conv_state,
            cu_seqlens,
            state_slots,
            has_init,
            y,
            T,
            Cd,
            S,
            max(1, S.bit_length()),
            *x.stride(),
            *weight.stride(),
            *conv_state.stride(),
            *y.stride(),
            K=K,
            HAS_BIAS=bias is not None,
            SILU=activation is not None,
            BLOCK_T=block_t,
            BLOCK_C=block_c,
            num_warps=cfg["num_warps"],
        )
    grid = (S, cdiv(Cd, block_c))
    _conv1d_varlen_state_kernel[grid](
        x,
        conv_state,
        cu_seqlens,
        state_slots,
        has_init,
        Cd,
        *x.stride(),
        *conv_state.stride(),
        KM1=K - 1,
        BLOCK_K=next_pow2(K - 1),
        BLOCK_C=block_c,
    )
    return y


@lazy_jit(do_not_specialize=("state_slots_ptr",))
def _conv1d_update_kernel(
    x_ptr,
    conv_state_ptr,
    weight_ptr,
    bias_ptr,
    state_slots_ptr,
    y_ptr,
    Cd,
    stride_x_b,
    stride_x_c,
    stride_s_slot,
    stride_s_c,
    stride_s_k,
    stride_w_c,
    stride_w_k,
    stride_y_b,
    stride_y_c,
    KM1: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    # With PDL everything but x is read before the wait: the weights, the slots (the
    # step's input) and this layer's conv state, which only this kernel's launch of the
    # step before wrote (complete: every step has launches that wait for all before
    # them), as the state update reads its state.
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    mask_c = offs_c < Cd
    slot = tl.load(state_slots_ptr + row).to(tl.int64)
    valid = slot >= 0
    state_row = conv_state_ptr + slot * stride_s_slot
    # The window and the window shifted by one are loaded together (both wait only on
    # the slot), not the shifted one after the output store, which the compiler cannot
    # move a load above (y and the state could alias for all it knows).
    inputs = conv_inputs(
        state_row, weight_ptr, bias_ptr, offs_c, mask_c, valid, stride_s_c, stride_s_k,
        stride_w_c, stride_w_k, 1, KM1, HAS_BIAS, BLOCK_K,
    )  # fmt: skip
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x_b + offs_c * stride_x_c, mask=mask_c, other=0.0)
    y, window = conv_apply(x, *inputs, y_ptr.dtype.element_ty, KM1, HAS_BIAS, SILU, BLOCK_K)
    y = tl.where(valid, y, 0.0)
    tl.store(
        y_ptr + row * stride_y_b + offs_c * stride_y_c, y.to(y_ptr.dtype.element_ty), mask=mask_c
    )
    # NOTE: column k+1 is read by the thread writing column k+1's neighbour.
    tl.debug_barrier()
    mask_ck = mask_c[:, None] & (offs_k < KM1)[None, :] & valid
    tl.store(
        state_row + offs_c[:, None] * stride_s_c + offs_k[None, :] * stride_s_k,
        window,
        mask=mask_ck,
    )


@device_function
def conv_inputs(
    conv_row_ptr,
    weight_ptr,
    bias_ptr,
    channels,
    mask_c,
    valid,
    stride_cs_c,
    stride_cs_k,
    stride_w_c,
    stride_w_k,
    stride_cb,
    KM1: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # What one token of the depthwise conv on `channels` of one row reads besides the new
    # input: the window, the window shifted by one, the weights (all taps but the last,
    # then the last) and the bias (zeros without one). No kernel of a decode step writes
    # them before the conv does, so a kernel may load them before its PDL wait.
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < KM1
    mask_ck = mask_c[:, None] & mask_k[None, :] & valid
    window_ptrs = conv_row_ptr + channels[:, None] * stride_cs_c + offs_k[None, :] * stride_cs_k
    window = tl.load(window_ptrs, mask=mask_ck, other=0.0)
    shifted = tl.load(
        window_ptrs + stride_cs_k, mask=mask_ck & (offs_k < KM1 - 1)[None, :], other=0.0
    )
    w = tl.load(
        weight_ptr + channels[:, None] * stride_w_c + offs_k[None, :] * stride_w_k,
        mask=mask_c[:, None] & mask_k[None, :],
        other=0.0,
    )
    w_last = tl.load(weight_ptr + channels * stride_w_c + KM1 * stride_w_k, mask=mask_c, other=0.0)
    bias = tl.zeros_like(w_last).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channels * stride_cb, mask=mask_c, other=0.0).to(tl.float32)
    return window, shifted, w, w_last, bias


@device_function
def conv_apply(
    x,
    window,
    shifted,
    w,
    w_last,
    bias,
    out_dtype: tl.constexpr,
    KM1: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The conv of the new input x over `conv_inputs`' window (`_conv1d_update_kernel`
    # runs it too, so a fused kernel gets the update's result bit for bit). Returns the
    # output in float32, rounded to out_dtype first (as the update stores it), and the
    # window shifted by one with x appended.
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1)
    acc += x.to(tl.float32) * w_last.to(tl.float32)
    if HAS_BIAS:
        acc += bias
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    out = acc.to(out_dtype).to(tl.float32)
    new_window = tl.where((offs_k == KM1 - 1)[None, :], x.to(shifted.dtype)[:, None], shifted)
    return out, new_window


def update_block_c(Bt: int, Cd: int, device: torch.device) -> int:
    """Channels per program of the conv update: up to 256, halved (down to 32) while the
    batch would leave under two programs an SM. At one row of Mamba-2.8B's 5120 channels,
    256 made 20 programs, whose serial loads (slot, window, x) took 5.6 µs on an H100
    (decode_profile, 2026-12-06)."""
    block_c = min(256, next_pow2(Cd))
    sms = num_sms(device) if device.type == "cuda" else 2
    while block_c > 32 and Bt * cdiv(Cd, block_c) < 2 * sms:
        block_c //= 2
    return block_c


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
    pdl: bool = False,
    config: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Triton twin of `causal_conv1d_update_ref`; no host sync (CUDA-graph safe).
    `config` overrides the launch parameters (block_c: channels a program, see
    `update_block_c`; num_warps: 4; benchmarks and tests only)."""
    _check_activation(activation)
    Bt, Cd, K = _check_conv_args(x, weight, bias, conv_state)
    check_shape("state_slots", state_slots, [Bt])
    y = torch.empty_like(x)
    if Bt == 0:
        return y
    default = {"block_c": update_block_c(Bt, Cd, x.device), "num_warps": 4}
    cfg = launch_config("conv1d_update", default, config)
    block_c = cfg["block_c"]
    grid = (Bt, cdiv(Cd, block_c))
    _conv1d_update_kernel[grid](
        x,
        conv_state,
        weight,
        bias,
        state_slots,
        y,
        Cd,
        *x.stride(),
        *conv_state.stride(),
        *weight.stride(),
        *y.stride(),
        KM1=K - 1,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        BLOCK_K=next_pow2(K - 1),
        BLOCK_C=block_c,
        PDL=pdl,
        num_warps=cfg["num_warps"],
        **pdl_launch(pdl),
    )
    return y
