"""Paged attention and KV write twins against dense causal attention."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded

from ssmserve.kernels.paged_attention import paged_attention_ref, write_kv_cache_ref


def dense_attention(q, k, v, scale, sliding_window=None):
    """q [Lq,H,Dh] at the last Lq positions of k/v [n,KVH,Dh]; float64."""
    Lq, H, _ = q.shape
    n, KVH, _ = k.shape
    out = torch.empty(Lq, H, q.shape[2], dtype=torch.float64)
    for i in range(Lq):
        pos = n - Lq + i
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        for h in range(H):
            kh = k[lo : pos + 1, h // (H // KVH)].double()
            vh = v[lo : pos + 1, h // (H // KVH)].double()
            p = torch.softmax(kh @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ vh
    return out


def build_case(ctx_lens, q_lens, H, KVH, Dh=12, block_size=4, dtype=torch.float32, seed=0):
    """Write full sequences through write_kv_cache_ref at random blocks."""
    gen = seeded(seed)
    S = len(ctx_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    max_blocks = max((n + block_size - 1) // block_size for n in seq_lens) + 1
    num_blocks = S * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = perm[: S * max_blocks].view(S, max_blocks).to(torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, KVH, Dh, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    keys = [randn(n, KVH, Dh, gen=gen, dtype=dtype) for n in seq_lens]
    values = [randn(n, KVH, Dh, gen=gen, dtype=dtype) for n in seq_lens]
    for s, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slot_mapping = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        slot_mapping[::3] = -1  # written below in a second call: tests the skip
        write_kv_cache_ref(keys[s], values[s], k_cache, v_cache, slot_mapping)
        rest = torch.full((n,), -1, dtype=torch.int64)
        rest[::3] = (block_tables[s, pos // block_size].long() * block_size + pos % block_size)[::3]
        write_kv_cache_ref(keys[s], values[s], k_cache, v_cache, rest)
    qs = [randn(q, H, Dh, gen=gen, dtype=dtype) for q in q_lens]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return dict(
        q=torch.cat(qs),
        qs=qs,
        keys=keys,
        values=values,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


@pytest.mark.parametrize("H,KVH", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_matches_dense(H, KVH, sliding_window, dtype):
    # prefill with cached context, plain prefill, two decodes, a block-aligned prefill
    ctx_lens, q_lens = [5, 0, 9, 1, 0], [6, 7, 1, 1, 8]
    case = build_case(ctx_lens, q_lens, H, KVH, dtype=dtype)
    scale = 12**-0.5
    out = paged_attention_ref(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        block_tables=case["block_tables"],
        query_start_loc=case["query_start_loc"],
        seq_lens=case["seq_lens"],
        scale=scale,
        sliding_window=sliding_window,
    )
    assert out.dtype == dtype
    qsl = case["query_start_loc"].tolist()
    for s in range(len(q_lens)):
        expected = dense_attention(
            case["qs"][s], case["keys"][s], case["values"][s], scale, sliding_window
        )
        assert_close(out[qsl[s] : qsl[s + 1]], expected, msg=f"sequence {s}")


def test_kv_write_skips_negative_slots():
    gen = seeded(5)
    k_cache = randn(3, 4, 2, 8, gen=gen)
    v_cache = randn(3, 4, 2, 8, gen=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k, v = randn(3, 2, 8, gen=gen), randn(3, 2, 8, gen=gen)
    write_kv_cache_ref(k, v, k_cache, v_cache, torch.tensor([9, -1, 0]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[0, 0], v[2])
    k_before[2, 1], k_before[0, 0] = k[0], k[2]
    v_before[2, 1], v_before[0, 0] = v[0], v[2]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_num_decodes_must_count_one_query_sequences():
    case = build_case([3, 5, 0], [1, 2, 4], H=2, KVH=1)
    kw = dict(
        block_tables=case["block_tables"],
        query_start_loc=case["query_start_loc"],
        seq_lens=case["seq_lens"],
        scale=0.5,
    )
    out = paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], **kw)
    assert torch.equal(
        paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], **kw, num_decodes=1), out
    )
    with pytest.raises(ValueError, match="each must be 1"):
        paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], **kw, num_decodes=2)
    with pytest.raises(ValueError, match="num_decodes must lie in"):
        paged_attention_ref(case["q"], case["k_cache"], case["v_cache"], **kw, num_decodes=4)
