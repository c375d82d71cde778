"""Physical floors: the least time a step can take, from the bytes it must move and the
FLOPs it must do, over a device's measured copy bandwidth and matrix-product rate.

A decode step reads every weight once (the input embedding table excepted: a lookup
reads one row per token), reads and writes each running request's SSM state (conv and
SSM state), reads its K/V for the context and writes one new position. A prefill does
2 FLOPs per weight per token (the LM head only for each sequence's last token) plus
causal attention. In a mixture-of-experts layer a forward reads only the experts its
tokens route to (counted as the expected number of distinct experts under uniform
routing: top_k for one token, all of them for many) and a token computes with its
top_k experts only. The scan's own FLOPs are left out (a few percent for Mamba2), so the
floor errs low. Floor = max(bytes / bandwidth, FLOPs / matrix rate).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DevicePeaks:
    """What one device does at best: copy bandwidth (bytes read + written per second) and
    16-bit dense matrix-product rate (FLOP/s)."""

    name: str
    bandwidth: float
    flops: float
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Measured on the card itself (device-to-device copy; bf16 GEMM at large square sizes);
# see DESIGN.md, Performance. Other devices: pass --bandwidth and --peak-tflops.
MEASURED_PEAKS = {
    "H200": DevicePeaks(
        "NVIDIA H200", 4.25e12, 783e12, "measured on an H200: device copy, bf16 GEMM"
    ),
    # The SXM card (HBM3); a PCIe H100 (HBM2e) has about 2 TB/s and takes no entry.
    "H100 80GB HBM3": DevicePeaks(
        "NVIDIA H100 80GB HBM3",
        3.02e12,
        691e12,
        "measured on an H100 80GB HBM3: device copy, bf16 GEMM "
        "(benchmarks/results/ceilings_2026-12-06_h100.json)",
    ),
}


def device_peaks(
    device_name: str, bandwidth_tb_s: float | None = None, peak_tflop_s: float | None = None
) -> DevicePeaks | None:
    """The peaks to compute floors with: the user's figures where given, else the table's
    entry for this device; None when neither is known (floors are then left out)."""
    known = next((p for key, p in MEASURED_PEAKS.items() if key in device_name), None)
    if bandwidth_tb_s is None and peak_tflop_s is None:
        return known
    for name, value in (("--bandwidth", bandwidth_tb_s), ("--peak-tflops", peak_tflop_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value}")
    if known is None and (bandwidth_tb_s is None or peak_tflop_s is None):
        raise ValueError(
            f"no measured peaks for {device_name!r}; pass both --bandwidth (TB/s) and "
            "--peak-tflops (TFLOP/s) for floors on this device"
        )
    return DevicePeaks(
        device_name,
        bandwidth_tb_s * 1e12 if bandwidth_tb_s is not None else known.bandwidth,
        peak_tflop_s * 1e12 if peak_tflop_s is not None else known.flops,
        "given on the command line" + ("" if known is None else f" (the rest: {known.source})"),
    )


@dataclass(frozen=True)
class ModelCosts:
    """What one forward of a model must move and compute, per token and per request."""

    body_params: int  # every parameter but the input embedding and the LM head
    head_params: int  # the LM head (vocab x hidden; the embedding table when tied)
    weight_bytes: int  # bytes of the weights each forward reads (body + head)
    state_bytes_per_seq: int  # conv + SSM state of one request
    kv_bytes_per_token: int  # K and V of one position over all attention layers
    attention_flops_per_pair: float  # FLOPs per (query, key) pair over all attention layers
    # per mixture-of-experts layer: (experts, top_k, bytes of one expert, params of one)
    expert_layers: tuple[tuple[int, int, int, int], ...] = ()

    def weights_read_bytes(self, tokens: float) -> float:
        """Weight bytes a forward over `tokens` tokens reads: all but the experts, and of
        each MoE layer the distinct experts the tokens route to (expected, uniform)."""
        routed = sum(
            per_expert * experts * (1 - (1 - top_k / experts) ** tokens)
            for experts, top_k, per_expert, _ in self.expert_layers
        )
        every = sum(experts * per_expert for experts, _, per_expert, _ in self.expert_layers)
        return self.weight_bytes - every + routed

    def active_body_params(self) -> int:
        """Body parameters one token computes with (its top_k experts of each MoE layer)."""
        idle = sum((e - k) * params for e, k, _, params in self.expert_layers)
        return self.body_params - idle

    def decode_step_bytes(self, batch: int, context: float) -> float:
        """Bytes of one decode step of `batch` requests at `context` tokens each."""
        per_seq = 2 * self.state_bytes_per_seq + self.kv_bytes_per_token * (context + 1)
        return self.weights_read_bytes(batch) + batch * per_seq

    def decode_step_flops(self, batch: int, context: float) -> float:
        per_seq = 2 * (self.active_body_params() + self.head_params)
        return batch * (per_seq + self.attention_flops_per_pair * (context + 1))

    def prefill_bytes(self, batch: int, length: int) -> float:
        """Weights read once; each sequence's final state and its K/V written."""
        per_seq = self.state_bytes_per_seq + self.kv_bytes_per_token * length
        return self.weights_read_bytes(batch * length) + batch * per_seq

    def prefill_flops(self, batch: int, length: int) -> float:
        per_seq = (
            2 * self.active_body_params() * length
            + 2 * self.head_params
            + self.attention_flops_per_pair * length * (length + 1) / 2
        )
        return batch * per_seq

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_costs(
    model: Any, hf_config: Any, dtype: torch.dtype, state_dtype: torch.dtype, block_size: int
) -> ModelCosts:
    """The costs of `model` (built for `hf_config`, weights in `dtype`), from its parameters
    and its cache sizes. Works on a model built on the meta device."""
    embedding = hf_config.vocab_size * hf_config.hidden_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    params = list(model.parameters())  # shared (tied) parameters once
    total = sum(p.numel() for p in params)
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    per_block, per_slot = _cache_bytes(model, block_size, dtype, state_dtype)
    kv_per_token = per_block / block_size
    heads = getattr(hf_config, "num_attention_heads", None) or 1
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    # K/V hold 2 x kv_heads x head_dim values per layer; scores and the weighted sum cost
    # 4 x heads x head_dim FLOPs per pair per layer: 2 x (heads / kv_heads) per K/V value.
    attention_flops = 2 * (heads / kv_heads) * kv_per_token / dtype.itemsize
    return ModelCosts(
        body_params=total - embedding * (1 if tied else 2),
        head_params=embedding,
        weight_bytes=total_bytes - (0 if tied else embedding * dtype.itemsize),
        state_bytes_per_seq=per_slot,
        kv_bytes_per_token=int(kv_per_token),
        attention_flops_per_pair=attention_flops,
        expert_layers=_expert_layers(model),
    )


def _expert_layers(model: Any) -> tuple[tuple[int, int, int, int], ...]:
    """(experts, top_k, bytes of one expert, params of one expert) of each MoE layer."""
    from ssmserve.layers.moe import FusedMoE

    layers = []
    for module in model.modules():
        if isinstance(module, FusedMoE):
            weights = (module.experts.up_weight(), module.experts.down_proj)
            experts = weights[0].shape[0]
            params = sum(w.numel() for w in weights) // experts
            per_expert = sum(w.numel() * w.element_size() for w in weights) // experts
            layers.append((experts, module.routing.top_k, per_expert, params))
    return tuple(layers)


def _cache_bytes(
    model: Any, block_size: int, dtype: torch.dtype, state_dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes of one KV block over all attention layers and of one request's SSM state."""
    from ssmserve.layers.cache import cache_bytes

    return cache_bytes(model.cache_specs(), block_size, dtype, state_dtype)


def meta_model(model_config: Any, dtype: torch.dtype) -> Any:
    """ssmserve's whole model (one rank's worth at tensor-parallel size 1) for
    `model_config`, built on the meta device: shapes without memory, at any size."""
    from ssmserve.distributed.parallel import TensorParallel
    from ssmserve.kernels import get_ops
    from ssmserve.models.base import ModelContext
    from ssmserve.models.registry import model_class

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(model_config.architecture)(
                model_config.hf_config, ModelContext(get_ops("torch", "cpu"), TensorParallel())
            )
    finally:
        torch.set_default_dtype(default)
    return model


def engine_costs(engine: Any) -> ModelCosts:
    """`model_costs` of the model an LLMEngine runs, with its dtypes and block size."""
    config = engine.config
    state_dtype = (
        engine.dtype
        if config.mamba_ssm_cache_dtype == "auto"
        else getattr(torch, config.mamba_ssm_cache_dtype)
    )
    model = meta_model(engine.model_config, engine.dtype)
    return model_costs(
        model, engine.model_config.hf_config, engine.dtype, state_dtype, config.block_size
    )


def floor_s(peaks: DevicePeaks | None, num_bytes: float, flops: float) -> float | None:
    """The least seconds to move `num_bytes` and do `flops`; None without peaks."""
    if peaks is None:
        return None
    return max(num_bytes / peaks.bandwidth, flops / peaks.flops)
