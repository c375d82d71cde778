"""Triton gated RMSNorm, KV write and paged attention against the PyTorch twins."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from test_ref_paged_attention import build_case
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.gated_rms_norm import (
    add_rms_norm_ref,
    add_rms_norm_triton,
    embed_rms_norm_ref,
    embed_rms_norm_triton,
    gated_rms_norm_ref,
    gated_rms_norm_triton,
)
from ssmserve.kernels.paged_attention import (
    paged_attention_ref,
    paged_attention_triton,
    write_kv_cache_ref,
    write_kv_cache_triton,
)

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [None, 12])
@pytest.mark.parametrize("gate", ["none", "after", "before"])
def test_gated_rms_norm_matches_twin(dtype, group_size, gate):
    gen = seeded(0)
    x, z = randn(5, 36, gen=gen, dtype=dtype), randn(5, 36, gen=gen, dtype=dtype)
    w = randn(36, gen=gen, dtype=dtype)
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=gate == "before")
    zz = None if gate == "none" else z
    args = [t.to(DEVICE) for t in (x, w)]
    y_ref = gated_rms_norm_ref(*args, None if zz is None else zz.to(DEVICE), **kw)
    y = gated_rms_norm_triton(*args, None if zz is None else zz.to(DEVICE), **kw)
    assert_close(y, y_ref)


@pytest.mark.parametrize(
    "width, group_size", [(5120, None), (8192, None), (8192, 1024)]
)  # Mamba2-2.7B's mixer, Bamba-9B's, Nemotron-H's groups: up to 16 warps a row
def test_gated_rms_norm_at_model_widths_matches_twin(width, group_size):
    """One decode row at the widths of real mixers, where the kernel takes the most
    warps (the tests above stay within one warp's width)."""
    gen = seeded(5)
    x, z = (randn(1, width, gen=gen, dtype=torch.bfloat16).to(DEVICE) for _ in range(2))
    w = (randn(width, gen=gen, dtype=torch.bfloat16) * 0.5 + 1).to(DEVICE)
    for gate in (None, z):
        want = gated_rms_norm_ref(x, w, gate, eps=1e-5, group_size=group_size)
        assert_close(gated_rms_norm_triton(x, w, gate, eps=1e-5, group_size=group_size), want)


@pytest.mark.parametrize(
    ("residual_dtype", "dtype"),
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float32,) * 2],
)
@pytest.mark.parametrize("hidden", [40, 64])
@pytest.mark.parametrize("cast_sum", [True, False])
def test_add_rms_norm_matches_twin(residual_dtype, dtype, hidden, cast_sum):
    gen = seeded(4)
    out = randn(5, hidden, gen=gen, dtype=dtype).to(DEVICE)
    residual = (randn(5, hidden, gen=gen, dtype=residual_dtype) * 4).to(DEVICE)
    w = randn(hidden, gen=gen, dtype=dtype).to(DEVICE)
    y_ref, s_ref = add_rms_norm_ref(out, residual, w, eps=1e-5, cast_sum=cast_sum)
    y, s = add_rms_norm_triton(out, residual, w, eps=1e-5, cast_sum=cast_sum)
    assert s.dtype == residual_dtype and torch.equal(s, s_ref)
    assert y.dtype == dtype
    assert_close(y, y_ref)
    if dtype == torch.float16 and DEVICE.type == "cpu":
        # The interpreter rounds to float16 as the twin does (numpy's float16; its bfloat16
        # truncates), so the kernel is the twin bit for bit, while the other choice of
        # cast_sum differs in about a third of the values.
        assert torch.equal(y, y_ref)
        other, _ = add_rms_norm_ref(out, residual, w, eps=1e-5, cast_sum=not cast_sum)
        assert not torch.equal(y, other)


@pytest.mark.parametrize(
    ("sum_dtype", "dtype"),
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float16,) * 2],
)
@pytest.mark.parametrize("hidden", [40, 64])
def test_embed_rms_norm_matches_twin(sum_dtype, dtype, hidden):
    """Rows gathered by id (repeated, out of order) from a table of more rows than tokens."""
    gen = seeded(7)
    table = (randn(30, hidden, gen=gen, dtype=dtype) * 3).to(DEVICE)
    w = randn(hidden, gen=gen, dtype=dtype).to(DEVICE)
    ids = torch.tensor([5, 29, 0, 5, 17], device=DEVICE)
    y_ref, s_ref = embed_rms_norm_ref(ids, table, w, eps=1e-5, sum_dtype=sum_dtype)
    y, s = embed_rms_norm_triton(ids, table, w, eps=1e-5, sum_dtype=sum_dtype)
    assert s.dtype == sum_dtype and torch.equal(s, s_ref)
    assert y.dtype == dtype
    assert_close(y, y_ref)
    if dtype == torch.float16 and DEVICE.type == "cpu":  # the interpreter rounds as the twin
        assert torch.equal(y, y_ref)


def test_write_kv_cache_matches_twin():
    gen = seeded(1)
    k, v = randn(5, 3, 6, gen=gen).to(DEVICE), randn(5, 3, 6, gen=gen).to(DEVICE)
    k_cache = randn(4, 4, 3, 6, gen=gen).to(DEVICE)
    v_cache = randn(4, 4, 3, 6, gen=gen).to(DEVICE)
    slots = torch.tensor([13, -1, 0, 7, 2], device=DEVICE)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
    write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


# decodes first (1 token, exactly one block, block + 1, long), then prefills: over cached
# context crossing a 16-query block, plain, with no queries, one token over context
DECODE_CTX, PREFILL_CTX, PREFILL_Q = [0, 3, 4, 37], [5, 0, 9, 2], [18, 7, 0, 1]


def attention_case(H, KVH, Dh, dtype, block_size=4, decode_ctx=DECODE_CTX, prefills=True):
    ctx = decode_ctx + (PREFILL_CTX if prefills else [])
    q_lens = [1] * len(decode_ctx) + (PREFILL_Q if prefills else [])
    case = build_case(ctx, q_lens, H, KVH, Dh=Dh, block_size=block_size, dtype=dtype)
    tensors = [case[n].to(DEVICE) for n in ("q", "k_cache", "v_cache")]
    kw = {n: case[n].to(DEVICE) for n in ("block_tables", "query_start_loc", "seq_lens")}
    return tensors, dict(kw, scale=Dh**-0.5)


# GQA factors 1, 2, 4, 8 and MQA with 6 heads; head dims below 16 and not powers of two
@pytest.mark.parametrize(
    "H,KVH,Dh,dtype",
    [
        (3, 3, 8, torch.float32),
        (4, 2, 12, torch.bfloat16),
        (8, 2, 8, torch.bfloat16),
        (16, 2, 20, torch.float32),
        (6, 1, 12, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_paged_attention_mixed_batch_matches_twin(H, KVH, Dh, dtype, sliding_window):
    (q, kc, vc), kw = attention_case(H, KVH, Dh, dtype)
    kw["sliding_window"] = sliding_window
    out_ref = paged_attention_ref(q, kc, vc, **kw)
    # all sequences through the prefill path, then the decodes through the decode path
    assert_close(paged_attention_triton(q, kc, vc, **kw), out_ref)
    out = paged_attention_triton(q, kc, vc, **kw, num_decodes=len(DECODE_CTX))
    assert_close(out, out_ref)


@pytest.mark.parametrize("sliding_window", [None, 21])
@pytest.mark.parametrize("mask_skip", [True, False])
def test_paged_attention_prefill_mask_skip_matches_twin(sliding_window, mask_skip):
    # 16-key tiles over up to 50 cached tokens: whole tiles before each query block's
    # diagonal, which mask_skip reads unmasked; a chunk with no context; one query.
    case = build_case([37, 50, 0, 3], [20, 9, 17, 1], 8, 2, Dh=8, block_size=4, seed=5)
    q, kc, vc = (case[n].to(DEVICE) for n in ("q", "k_cache", "v_cache"))
    kw = {n: case[n].to(DEVICE) for n in ("block_tables", "query_start_loc", "seq_lens")}
    kw.update(scale=8**-0.5, sliding_window=sliding_window)
    cfg = dict(block_m=16, block_n=16, num_warps=4, num_stages=2, mask_skip=mask_skip)
    out = paged_attention_triton(q, kc, vc, **kw, prefill_config=cfg)
    assert_close(out, paged_attention_ref(q, kc, vc, **kw))


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (8, 64)])
@pytest.mark.parametrize("sliding_window", [None, 21])
@pytest.mark.parametrize("options", [{}, {"prefetch": True}, {"mask_skip": False}])
def test_paged_attention_decode_splits_match_twin(num_splits, block_n, sliding_window, options):
    # ragged contexts at the engine's block size; 100 tokens is 7 tiles of 16, so with 3
    # splits of 3 tiles the last split is short, and 1-token contexts leave splits empty
    # prefetch: each split's first tile read apart, its last token (the step's own, which
    # RoPE writes under PDL) after the rest; without mask_skip every tile is masked.
    cfg = dict(block_m=16, block_n=block_n, num_splits=num_splits, num_warps=4, num_stages=2)
    (q, kc, vc), kw = attention_case(
        8, 2, 8, torch.float32, block_size=16, decode_ctx=[0, 15, 16, 99, 63], prefills=False
    )
    kw["sliding_window"] = sliding_window
    # Freed memory full of inf, which the split partials' scratch may reuse: a merge that
    # read scratch the kernel never wrote would raise (inf * 0) in the interpreter.
    poison = [torch.full((n,), float("inf"), device=DEVICE) for n in (64, 256, 1024, 4096)]
    del poison
    plain = dict(cfg, prefetch=False, mask_skip=True)
    out = paged_attention_triton(
        q, kc, vc, **kw, num_decodes=5, decode_config=dict(plain, **options)
    )
    assert_close(out, paged_attention_ref(q, kc, vc, **kw))
    if options:  # the same sums in the same order (the GPU may contract them apart)
        expected = paged_attention_triton(q, kc, vc, **kw, num_decodes=5, decode_config=plain)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_decode_padding_rows_touch_nothing():
    # The shape of a CUDA-graph decode batch padded from 3 to 6 rows: padding rows have
    # one query, seq_len 1, KV slot -1 and a block-table row of zeros or stale blocks.
    (q, kc, vc), kw = attention_case(4, 2, 8, torch.bfloat16, decode_ctx=[4, 0, 30], prefills=False)
    n, size = 3, 6
    gen = seeded(7)
    q_pad = torch.cat([q, randn(size - n, 4, 8, gen=gen, dtype=q.dtype).to(DEVICE)])
    tables = torch.zeros(size, kw["block_tables"].shape[1], dtype=torch.int32, device=DEVICE)
    tables[:n] = kw["block_tables"]
    tables[n + 1] = kw["block_tables"][0]  # stale row left by an earlier, larger batch
    padded = dict(
        block_tables=tables,
        query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat(
            [kw["seq_lens"], torch.ones(size - n, dtype=torch.int32, device=DEVICE)]
        ),
        scale=kw["scale"],
    )
    k_new = randn(size, 2, 8, gen=gen, dtype=q.dtype).to(DEVICE)
    slots = torch.full((size,), -1, dtype=torch.long, device=DEVICE)
    kc_before, vc_before = kc.clone(), vc.clone()
    write_kv_cache_triton(k_new, k_new, kc, vc, slots)
    out = paged_attention_triton(q_pad, kc, vc, **padded, num_decodes=size)
    assert torch.equal(kc, kc_before) and torch.equal(vc, vc_before)
    assert_close(out[:n], paged_attention_ref(q, kc, vc, **kw, num_decodes=n))
    assert torch.isfinite(out[n:].float()).all()
