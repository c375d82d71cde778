"""Mixture of experts: routing and the PyTorch twin against a naive per-token loop over
experts (float64), the Triton kernel against the twin (interpreter on CPU)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.moe import (
    ALIGN_MAX_ROWS,
    align_by_expert,
    align_by_expert_ref,
    fused_moe_ref,
    fused_moe_triton,
    moe_launch_config,
    moe_route_ref,
    moe_route_triton,
)
from ssmserve.layers.moe import Routing, select_experts


def naive_route(logits: list[float], routing: Routing, bias: list[float] | None):
    """One token's chosen experts and weights, by sorting Python floats."""
    E = len(logits)
    if routing.scoring == "softmax":
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        scores = [v / sum(exps) for v in exps]
    else:
        scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    allowed = set(range(E))
    if routing.num_groups > 1:
        per = E // routing.num_groups
        group_score = [
            sum(sorted(choice[g * per : (g + 1) * per], reverse=True)[:2])
            for g in range(routing.num_groups)
        ]
        best = sorted(range(routing.num_groups), key=lambda g: -group_score[g])
        allowed = {g * per + i for g in best[: routing.topk_groups] for i in range(per)}
    chosen = sorted(allowed, key=lambda i: -choice[i])[: routing.top_k]
    weights = [scores[i] for i in chosen]
    if routing.renormalize:
        weights = [w / sum(weights) for w in weights]
    return chosen, [w * routing.routed_scaling_factor for w in weights]


def act(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return h * torch.sigmoid(h)
    if activation == "gelu":
        return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return torch.clamp(h, min=0) ** 2


def naive_moe(x, w13, w2, chosen, weights, activation, gated):
    """sum over a token's experts of weight * expert(x), one token and expert at a time."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(chosen[t], weights[t], strict=True):
            h = w13[e] @ x[t]
            h = act(h[:inter], activation) * h[inter:] if gated else act(h, activation)
            out[t] += w * (w2[e] @ h)
    return out


def expert_weights(E, H, I, gated, gen, dtype=torch.float32):  # noqa: E741
    w13 = randn(E, (2 if gated else 1) * I, H, gen=gen, dtype=dtype, scale=H**-0.5)
    return w13, randn(E, H, I, gen=gen, dtype=dtype, scale=I**-0.5)


ROUTINGS = {
    "softmax_top1": Routing(top_k=1),
    "softmax_top2": Routing(top_k=2),
    "softmax_top2_renorm": Routing(top_k=2, renormalize=True),
    "sigmoid_top2": Routing(top_k=2, scoring="sigmoid"),
    "sigmoid_top3_renorm_scaled": Routing(
        top_k=3, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5
    ),
    "sigmoid_grouped": Routing(
        top_k=2, scoring="sigmoid", renormalize=True, num_groups=3, topk_groups=2
    ),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_routing_and_twin_match_a_naive_loop_over_tokens_and_experts(name, with_bias):
    routing = ROUTINGS[name]
    gen = seeded(0)
    T, H, I, E = 23, 20, 14, 6  # noqa: E741
    x = randn(T, H, gen=gen)
    logits = randn(T, E, gen=gen, scale=2.0)
    # Uneven loads: expert 1 is popular, expert 4 is never chosen.
    logits[:, 1] += 1.5
    logits[:, 4] -= 30.0
    bias = None
    if with_bias:
        bias = randn(E, gen=gen, scale=0.1)
        bias[4] = -1.0  # the bias moves choices, but must not revive the idle expert
    ref = [
        naive_route(row, routing, bias.tolist() if bias is not None else None)
        for row in logits.tolist()
    ]
    weights, ids = select_experts(logits, routing, bias)
    for t, (chosen, ref_w) in enumerate(ref):
        order = ids[t].argsort()
        assert ids[t][order].tolist() == sorted(chosen), t
        got_w = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        assert [got_w[e] for e in chosen] == pytest.approx(ref_w, rel=1e-5, abs=1e-7), t
    loads = torch.bincount(ids.flatten(), minlength=E)
    assert loads[4] == 0 and loads[1] == loads.max() and loads.max() > loads[loads > 0].min()
    for gated, activation in [(True, "silu"), (False, "relu2")]:
        w13, w2 = expert_weights(E, H, I, gated, gen)
        out = fused_moe_ref(x, w13, w2, weights, ids, activation=activation, gated=gated)
        expected = naive_moe(
            x, w13, w2, [r[0] for r in ref], [r[1] for r in ref], activation, gated
        )
        assert_close(out, expected, msg=f"gated={gated}")


def test_twin_gelu_and_zero_tokens():
    gen = seeded(1)
    w13, w2 = expert_weights(3, 8, 5, True, gen)
    x, ids = randn(4, 8, gen=gen), torch.tensor([[0, 2], [2, 0], [2, 1], [0, 0]])
    weights = torch.rand(4, 2, generator=gen)
    out = fused_moe_ref(x, w13, w2, weights, ids, activation="gelu")
    assert_close(out, naive_moe(x, w13, w2, ids.tolist(), weights.tolist(), "gelu", True))
    empty = fused_moe_ref(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 8)


def test_bad_arguments_are_refused():
    gen = seeded(2)
    w13, w2 = expert_weights(3, 8, 5, True, gen)
    x, ids, w = randn(2, 8, gen=gen), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(ValueError, match="activation 'tanh' is not supported"):
        fused_moe_ref(x, w13, w2, w, ids, activation="tanh")
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_moe_ref(x, w13, w2[:, :, :4], w, ids)
    with pytest.raises(ValueError, match="n_group = 4"):
        Routing(top_k=2, num_groups=4).check(6)
    with pytest.raises(ValueError, match="num_experts_per_tok = 7"):
        Routing(top_k=7).check(6)


@pytest.mark.parametrize(
    ("num_rows", "num_experts", "block_m"), [(1, 4, 16), (46, 6, 16), (9, 3, 4)]
)
def test_alignment_gives_each_block_one_expert_and_every_assignment_once(
    num_rows, num_experts, block_m
):
    gen = seeded(3)
    ids = torch.randint(0, num_experts - 1, (num_rows, 1), generator=gen)  # last expert idle
    rows, block_expert = align_by_expert_ref(ids, num_experts, block_m)
    assert rows.shape == (block_expert.shape[0] * block_m,)
    real = rows[rows < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))
    for b, e in enumerate(block_expert.tolist()):
        block = rows[b * block_m : (b + 1) * block_m]
        block = block[block < num_rows]
        if e == num_experts:
            assert block.numel() == 0
        else:
            assert block.numel() > 0 and (ids.flatten()[block] == e).all(), (b, e)


@requires_triton
@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_routing_matches_a_naive_sort(name, with_bias):
    """Every routing variant, E not a power of two (and 40 experts in 4 groups of 10)."""
    routing = ROUTINGS[name]
    gen = seeded(1)
    E = 40 if routing.num_groups > 1 else 13
    if routing.num_groups > 1:
        routing = dataclasses.replace(routing, num_groups=4, topk_groups=2, top_k=5)
    logits = randn(9, E, gen=gen, scale=2.0)
    logits[:, 3] -= 30.0
    bias = randn(E, gen=gen, scale=0.1) if with_bias else None
    kw = dataclasses.asdict(routing)
    weights, ids = moe_route_triton(
        logits.to(DEVICE), None if bias is None else bias.to(DEVICE), **kw
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    for t, row in enumerate(logits.tolist()):
        chosen, ref_w = naive_route(row, routing, bias.tolist() if with_bias else None)
        assert ids[t].tolist() == chosen, t  # best first
        assert weights[t].tolist() == pytest.approx(ref_w, rel=1e-5, abs=1e-7), t
    ref_weights, ref_ids = moe_route_ref(logits, bias, **kw)
    assert torch.equal(ids.cpu(), ref_ids)
    assert_close(weights.cpu(), ref_weights)


@requires_triton
def test_triton_routing_of_no_tokens_and_bad_arguments():
    logits = torch.zeros(0, 6, device=DEVICE)
    weights, ids = moe_route_triton(logits, top_k=2)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k = 7 must lie in"):
        moe_route_triton(torch.zeros(2, 6, device=DEVICE), top_k=7)
    with pytest.raises(ValueError, match="cannot form 4 groups"):
        moe_route_triton(torch.zeros(2, 6, device=DEVICE), top_k=2, num_groups=4)
    with pytest.raises(ValueError, match="scoring 'tanh'"):
        moe_route_ref(torch.zeros(2, 6), top_k=2, scoring="tanh")


@requires_triton
@pytest.mark.parametrize(
    ("T", "K", "E", "block_m"),
    [(1, 2, 5, 16), (7, 6, 64, 16), (300, 2, 13, 16), (40, 3, 4, 64), (9, 1, 130, 4)],
)
def test_one_launch_alignment_equals_the_sort(T, K, E, block_m):
    """Element for element the PyTorch ops' result: more assignments than one count tile
    (300 x 2 over 13 experts), idle experts, E not a power of two, wide blocks."""
    gen = seeded(T + E)
    ids = torch.randint(0, max(1, E - 2), (T, K), generator=gen)  # the last experts idle
    for got, expected in zip(
        align_by_expert(ids.to(DEVICE), E, block_m), align_by_expert_ref(ids, E, block_m)
    ):
        assert torch.equal(got.cpu(), expected.to(torch.int32)), (got, expected)
    big = torch.zeros(ALIGN_MAX_ROWS + 1, 1, dtype=torch.int64)  # past the bound: the sort
    assert torch.equal(align_by_expert(big, 4, 16)[0], align_by_expert_ref(big, 4, 16)[0])


# (T, K, E): decode-sized (the per-assignment kernels), and enough rows per expert to take
# the sorted path's wider launch configs
TRITON_SHAPES = [(1, 2, 5), (3, 3, 4), (7, 2, 4), (13, 1, 6), (40, 3, 4), (70, 2, 2)]


@requires_triton
@pytest.mark.parametrize(("T", "K", "E"), TRITON_SHAPES)
@pytest.mark.parametrize(
    ("gated", "activation"), [(True, "silu"), (False, "relu2"), (True, "gelu")]
)
def test_triton_matches_twin_float32(T, K, E, gated, activation):
    gen = seeded(T * 7 + E)
    H, I = 36, 20  # noqa: E741
    w13, w2 = expert_weights(E, H, I, gated, gen)
    x = randn(T, H, gen=gen)
    weights, ids = select_experts(randn(T, E, gen=gen), Routing(top_k=K, renormalize=True))
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    kw = dict(activation=activation, gated=gated)
    assert_close(fused_moe_triton(*args, **kw), fused_moe_ref(*args, **kw))


@requires_triton
@pytest.mark.parametrize(("T", "K", "E"), [(5, 2, 4), (40, 2, 3)])
def test_triton_bfloat16_matches_float32_twin(T, K, E):
    gen = seeded(11)
    H, I = 24, 40  # noqa: E741
    w13, w2 = expert_weights(E, H, I, True, gen, dtype=torch.bfloat16)
    x = randn(T, H, gen=gen, dtype=torch.bfloat16)
    weights, ids = select_experts(randn(T, E, gen=gen), Routing(top_k=K))
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    out = fused_moe_triton(*args)
    assert out.dtype == torch.bfloat16
    ref = fused_moe_ref(*(t.float() if t.is_floating_point() else t for t in args))
    assert_close(out, ref, dtype=torch.bfloat16)


@requires_triton
def test_triton_with_strided_input_and_no_tokens():
    gen = seeded(5)
    w13, w2 = expert_weights(3, 16, 12, True, gen)
    wide = randn(6, 40, gen=gen)
    x = wide[:, 3:19]  # rows with a stride that is not the hidden size
    weights, ids = select_experts(randn(6, 3, gen=gen), Routing(top_k=2))
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    assert_close(fused_moe_triton(*args), fused_moe_ref(*args))
    x0, w13d, w2d, w0, ids0 = args
    assert fused_moe_triton(x0[:0], w13d, w2d, w0[:0], ids0[:0]).shape == (0, 16)


@requires_triton
def test_triton_launch_parameters_are_arguments_and_are_validated():
    gen = seeded(6)
    w13, w2 = expert_weights(4, 20, 12, True, gen)
    weights, ids = select_experts(randn(9, 4, gen=gen), Routing(top_k=2))
    args = [t.to(DEVICE) for t in (randn(9, 20, gen=gen), w13, w2, weights, ids)]
    ref = fused_moe_ref(*args)
    pinned = {"block_m": 32, "block_n": 16, "block_k": 16, "num_warps": 2}
    assert moe_launch_config(18, 4, pinned) == {**moe_launch_config(18, 4), **pinned}
    # Prefill over large experts takes 128-row blocks once each expert has 128 rows.
    jamba = moe_launch_config(8192, 16, intermediate=14336)
    assert jamba == {**moe_launch_config(8192, 16), "block_m": 128}
    assert moe_launch_config(8192, 16, intermediate=512)["block_m"] == 64
    assert moe_launch_config(1024, 16, intermediate=14336)["block_m"] == 64  # 64 rows each
    assert_close(fused_moe_triton(*args, config={**jamba, "block_n": 16, "block_k": 16}), ref)
    assert_close(fused_moe_triton(*args, config=pinned), ref)
    with pytest.raises(ValueError, match="unknown launch parameter"):
        fused_moe_triton(*args, config={"block_h": 16})
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        fused_moe_triton(*args, config={"block_m": 24})
