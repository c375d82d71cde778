"""RoPE, the KV write and decode attention in one launch (`rotary_decode_attention`)
against the two launches it replaces and against its twin."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from test_ref_paged_attention import build_case
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels import rotary as rotary_module
from ssmserve.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from ssmserve.kernels.rotary import (
    rotary_decode_attention_ref,
    rotary_decode_attention_triton,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

H, KVH, BLOCK = 8, 2, 16
# Cached tokens before each decode: none, one block less one, one block (the step's key
# opens a tile), 99 (seven 16-key tiles), 63 (the step's key closes the fourth tile,
# the one mask_skip would read unmasked), then a padding row of a CUDA-graph batch.
CONTEXTS = [0, 15, 16, 99, 63]


def decode_case(dtype, head_dim, rotary_dim, seed=0):
    """Caches holding each sequence's context, this step's projections as slices of one
    qkv tensor, and the step's inputs; the last row is padding (slot -1, length 1)."""
    case = build_case(CONTEXTS, [0] * len(CONTEXTS), H, KVH, Dh=head_dim, block_size=BLOCK,
                      dtype=dtype, seed=seed)  # fmt: skip
    gen = seeded(seed + 1)
    S = len(CONTEXTS) + 1
    T = S
    qkv = randn(T, (H + 2 * KVH) * head_dim, gen=gen, dtype=dtype)
    q, k, v = (
        t.view(T, -1, head_dim)
        for t in qkv.split([H * head_dim, KVH * head_dim, KVH * head_dim], dim=-1)
    )
    tables = torch.cat([case["block_tables"], case["block_tables"][:1]])  # a stale row
    positions = torch.tensor([*CONTEXTS, 0])
    slots = tables[torch.arange(S), positions // BLOCK].long() * BLOCK + positions % BLOCK
    slots[-1] = -1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    step = dict(
        positions=positions,
        inv_freq=inv_freq,
        scaling=1.25,
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc=torch.arange(S + 1, dtype=torch.int32),
        seq_lens=positions.to(torch.int32) + 1,
        scale=head_dim**-0.5,
    )
    step = {n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in step.items()}
    caches = (case["k_cache"].to(DEVICE), case["v_cache"].to(DEVICE))
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)), caches, step


def two_launches(rope, attention, q, k, v, k_cache, v_cache, step, **attention_kw):
    """What the layer ran before: RoPE with its cache write, then the attention."""
    q, _ = rope(
        step["positions"], q, k, step["inv_freq"], scaling=step["scaling"],
        v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=step["slot_mapping"],
    )  # fmt: skip
    return attention(
        q, k_cache, v_cache, block_tables=step["block_tables"],
        query_start_loc=step["query_start_loc"], seq_lens=step["seq_lens"],
        scale=step["scale"], num_decodes=q.shape[0], **attention_kw,
    )  # fmt: skip


def test_twin_is_rope_then_attention():
    (q, k, v), caches, step = decode_case(torch.float32, 12, 8)
    kc, vc = (c.clone() for c in caches)
    out = rotary_decode_attention_ref(q, k, v, kc, vc, **step)
    kc2, vc2 = (c.clone() for c in caches)
    expected = two_launches(rotary_embedding_ref, paged_attention_ref, q, k, v, kc2, vc2, step)
    assert torch.equal(out, expected)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc, caches[0])  # the step's keys were written


# float16 over every launch form; partial rotary and float32 over the one launch with
# several splits (the interpreter is slow: each case runs the kernels in Python).
FP16, PARTIAL, FP32 = (torch.float16, 16, 16), (torch.float16, 12, 8), (torch.float32, 16, 16)
SPLITS = {"num_splits": 8, "prefetch": True}


@requires_triton
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize(
    ("case", "options"),
    [
        (FP16, SPLITS),
        (FP16, {"num_splits": 1, "prefetch": True}),
        (FP16, {"num_splits": 3, "prefetch": True, "mask_skip": False}),
        (FP16, {"num_splits": 3}),
        (PARTIAL, SPLITS),
        (FP32, SPLITS),
    ],
    ids=["splits", "one-split", "no-mask-skip", "two-launches", "partial-rotary", "fp32"],
)
def test_triton_is_the_two_launches_bit_for_bit(case, options, monkeypatch):
    """Output and caches equal `rotary_embedding_triton` then `paged_attention_triton`
    with the same launch parameters, bit for bit in the interpreter (the queries rotated
    with the same rounding, the step's key taken from registers in its tile), and the
    twin within the dtype's tolerance; one launch with `prefetch`, the two without. The
    padding row writes nothing. The GPU compiles the two kernels apart and may contract
    their sums apart (a multiply and add as one FMA, the dot's accumulator): there the
    16-bit caches stay exact (each product and sum is rounded to the dtype) and the rest
    within a few units of the last place."""
    dtype = case[0]
    (q, k, v), caches, step = decode_case(*case)
    cfg = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, prefetch=False, mask_skip=True)
    cfg.update(options)
    rope_launches = []
    rope = rotary_module.rotary_embedding_triton
    monkeypatch.setattr(
        rotary_module,
        "rotary_embedding_triton",
        lambda *a, **kw: rope_launches.append(1) or rope(*a, **kw),
    )
    kc, vc = (c.clone() for c in caches)
    out = rotary_decode_attention_triton(q, k, v, kc, vc, **step, decode_config=cfg)
    assert len(rope_launches) == (0 if cfg["prefetch"] else 1)
    kc2, vc2 = (c.clone() for c in caches)
    expected = two_launches(
        rotary_embedding_triton, paged_attention_triton, q, k, v, kc2, vc2, step,
        decode_config=cfg,
    )  # fmt: skip
    real = slice(0, len(CONTEXTS))  # the padding row's query may see other keys
    if DEVICE.type == "cpu":
        assert torch.equal(out[real], expected[real])
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    else:
        tol = 1e-6 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(out[real], expected[real], atol=tol, rtol=tol)
        torch.testing.assert_close(kc, kc2, atol=tol, rtol=tol)
        assert torch.equal(vc, vc2)
        if dtype != torch.float32:
            assert torch.equal(kc, kc2)
    assert torch.isfinite(out.float()).all()
    kc3, vc3 = (c.clone() for c in caches)
    assert_close(out[real], rotary_decode_attention_ref(q, k, v, kc3, vc3, **step)[real])


def test_refuses_a_batch_with_prefills():
    (q, k, v), (kc, vc), step = decode_case(torch.float32, 12, 8)
    step["query_start_loc"] = torch.tensor([0, 1, 2, 3, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="decodes only"):
        rotary_decode_attention_ref(q, k, v, kc, vc, **step)


@requires_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes: a GPU's work")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
# (batch, context, the block table's tokens): with PDL the first two take one launch
# (splits of two 64-key tiles), the own key in its split's first tile, then in its
# second; the last two take two launches.
@pytest.mark.parametrize(
    ("batch", "context", "table"),
    [(1, 2200, 4096), (1, 2047, 2048), (8, 4000, 4016), (64, 511, 512)],
)
def test_at_llama_sizes_on_the_gpu(batch, context, table, pdl):
    """Llama-3-8B's attention (32 / 8 heads of 128, bf16, 16-token blocks) at the decode
    launch parameters the GPU picks: the caches bit for bit the two launches', the
    output within a unit of bf16's last place (the kernels compile apart, see above)."""
    heads, kv_heads, D = 32, 8, 128
    gen = seeded(batch + context)
    width = table // 16
    tables = torch.randperm(batch * width + 5, generator=gen)[: batch * width].view(batch, width)
    k_cache, v_cache = (
        randn(batch * width + 5, 16, kv_heads, D, gen=gen, dtype=torch.bfloat16).cuda()
        for _ in range(2)
    )
    qkv = randn(batch, (heads + 2 * kv_heads) * D, gen=gen, dtype=torch.bfloat16).cuda()
    q, k, v = (t.view(batch, -1, D) for t in qkv.split([heads * D, kv_heads * D, kv_heads * D], -1))
    lengths = torch.tensor([context - 7 * i for i in range(batch)])
    positions = lengths - 1
    slots = tables[torch.arange(batch), positions // 16] * 16 + positions % 16
    step = dict(
        positions=positions.cuda(),
        inv_freq=(1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))).cuda(),
        slot_mapping=slots.cuda(),
        block_tables=tables.to(torch.int32).cuda(),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32).cuda(),
        seq_lens=lengths.to(torch.int32).cuda(),
        scale=D**-0.5,
    )
    kc, vc = k_cache.clone(), v_cache.clone()
    out = rotary_decode_attention_triton(q, k, v, kc, vc, **step, pdl=pdl)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    expected = two_launches(
        lambda *a, **kw: rotary_embedding_triton(*a, **kw, pdl=pdl),
        paged_attention_triton, q, k, v, kc2, vc2, dict(step, scaling=1.0), pdl=pdl,
    )  # fmt: skip
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=2**-8)
