"""The MoE layer's sharding and loading: expert shards on simulated ranks sum to the whole
mixture computed from the checkpoint's per-expert tensors, and per-expert and fused
checkpoint tensors load the same parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.kernels import get_ops
from ssmserve.layers.moe import FusedMoE, Routing, select_experts

H, I, E, SHARED = 10, 7, 4, 5  # noqa: E741


def checkpoint_tensors(gated: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    names = ["gate_proj", "up_proj"] if gated else ["up_proj"]
    tensors = {"router.weight": torch.randn(E, H, generator=gen)}
    for e in range(E):
        for n in names:
            tensors[f"experts.{e}.{n}.weight"] = torch.randn(I, H, generator=gen) / H**0.5
        tensors[f"experts.{e}.down_proj.weight"] = torch.randn(H, I, generator=gen) / I**0.5
    for n in names:
        tensors[f"shared_experts.{n}.weight"] = torch.randn(SHARED, H, generator=gen) / H**0.5
    tensors["shared_experts.down_proj.weight"] = torch.randn(H, SHARED, generator=gen)
    return tensors


def reference(x: torch.Tensor, t: dict[str, torch.Tensor], gated: bool, top_k: int) -> torch.Tensor:
    """Softmax routing, renormalised, then each token's experts one by one."""
    probs = F.linear(x, t["router.weight"]).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)

    def mlp(prefix: str, v: torch.Tensor) -> torch.Tensor:
        up = t[f"{prefix}.up_proj.weight"] @ v
        h = F.silu(t[f"{prefix}.gate_proj.weight"] @ v) * up if gated else F.silu(up)
        return t[f"{prefix}.down_proj.weight"] @ h

    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for w, e in zip(weights[i].tolist(), ids[i].tolist(), strict=True):
            out[i] += w * mlp(f"experts.{e}", x[i])
        out[i] += mlp("shared_experts", x[i])
    return out


def build(tp: TensorParallel, gated: bool, top_k: int) -> FusedMoE:
    return FusedMoE(
        hidden_size=H,
        intermediate_size=I,
        num_experts=E,
        routing=Routing(top_k=top_k, renormalize=True),
        ops=get_ops("torch", "cpu"),
        tp=tp,
        gated=gated,
        shared_intermediate_size=SHARED,
        reduce_results=False,
    )


def load(layer: FusedMoE, tensors: dict[str, torch.Tensor], fused: bool) -> None:
    """Through the weight loaders, as the checkpoint loader does."""
    params = dict(layer.named_parameters())
    segments = {"gate_proj": 0, "up_proj": 1 if layer.gated else 0}
    up_name = "experts.gate_up_proj" if layer.gated else "experts.up_proj"
    if fused:
        parts = ["gate_proj", "up_proj"] if layer.gated else ["up_proj"]
        stacked = torch.stack(
            [torch.cat([tensors[f"experts.{e}.{n}.weight"] for n in parts]) for e in range(E)]
        )
        down = torch.stack([tensors[f"experts.{e}.down_proj.weight"] for e in range(E)])
        params[up_name].weight_loader(params[up_name], stacked, None)
        p = params["experts.down_proj"]
        p.weight_loader(p, down, None)
    for name, tensor in tensors.items():
        if name.startswith("experts."):
            if fused:
                continue
            _, e, proj, _ = name.split(".")
            target = "experts.down_proj" if proj == "down_proj" else up_name
            shard = (int(e), 0 if proj == "down_proj" else segments[proj])
            params[target].weight_loader(params[target], tensor, shard)
        elif name.startswith("shared_experts.") and layer.gated and "down" not in name:
            p = params["shared_experts.gate_up_proj.weight"]
            p.weight_loader(p, tensor, 0 if "gate_proj" in name else 1)
        else:
            params[name].weight_loader(params[name], tensor, None)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("gated", [True, False])
def test_expert_shards_sum_to_the_whole_mixture(size, gated):
    tensors = checkpoint_tensors(gated)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    total = torch.zeros(9, H)
    for rank in range(size):
        layer = build(TensorParallel(rank=rank, size=size), gated, top_k=2)
        # A gated shared expert runs act(gate) * up as the kernel set's one fused op.
        assert (getattr(layer.shared_experts, "fused_act", None) is not None) == gated
        load(layer, tensors, fused=False)
        total += layer(x)
    torch.testing.assert_close(total, reference(x, tensors, gated, top_k=2))


@pytest.mark.parametrize("gated", [True, False])
def test_fused_and_per_expert_checkpoint_tensors_load_the_same_shard(gated):
    tensors = checkpoint_tensors(gated, seed=1)
    tp = TensorParallel(rank=1, size=3)
    a, b = build(tp, gated, top_k=1), build(tp, gated, top_k=1)
    load(a, tensors, fused=False)
    load(b, tensors, fused=True)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_wrong_expert_shapes_and_too_many_ranks_are_refused():
    layer = build(TensorParallel(), True, top_k=2)
    p = layer.experts.gate_up_proj
    with pytest.raises(ValueError, match=r"expected \(7, 10\)"):
        p.weight_loader(p, torch.zeros(6, 10), (0, 1))
    with pytest.raises(ValueError, match=r"expected \(4, 14, 10\)"):
        p.weight_loader(p, torch.zeros(4, 12, 10), None)
    with pytest.raises(ValueError, match="more than the 7 intermediate channels"):
        build(TensorParallel(rank=7, size=8), True, top_k=2)
    with pytest.raises(ValueError, match="expert activation"):
        FusedMoE(
            hidden_size=H,
            intermediate_size=I,
            num_experts=E,
            routing=Routing(top_k=2),
            ops=get_ops("torch", "cpu"),
            tp=TensorParallel(),
            activation="tanh",
        )


def test_float32_router_and_correction_bias_reach_the_experts():
    captured = {}

    def fused_moe(x, w13, w2, weights, ids, **kw):
        captured.update(weights=weights, ids=ids)
        return torch.zeros_like(x)

    ops = dataclasses.replace(get_ops("torch", "cpu"), fused_moe=fused_moe)
    routing = Routing(top_k=2, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = FusedMoE(
            hidden_size=H,
            intermediate_size=I,
            num_experts=E,
            routing=routing,
            ops=ops,
            tp=TensorParallel(),
            correction_bias=True,
            router_in_float32=True,
        )
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(7)
    layer.router.weight.data.copy_(torch.randn(E, H, generator=gen))
    layer.router.e_score_correction_bias.data.copy_(torch.tensor([0.0, 0.5, 0.0, -0.5]))
    x = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    layer(x)
    logits = F.linear(x.float(), layer.router.weight.float())
    bias = layer.router.e_score_correction_bias
    weights, ids = select_experts(logits, routing, bias)
    assert torch.equal(captured["ids"], ids) and torch.equal(captured["weights"], weights)
    assert captured["weights"].dtype == torch.float32
