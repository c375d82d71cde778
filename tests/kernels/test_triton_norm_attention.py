"""Triton gated RMSNorm, KV write and paged attention against the PyTorch twins."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from test_ref_paged_attention import build_case
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.gated_rms_norm import gated_rms_norm_ref, gated_rms_norm_triton
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


@pytest.mark.parametrize("H,KVH", [(4, 2), (3, 1)])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_twin(H, KVH, sliding_window, dtype):
    # prefill over cached context (crossing a 16-query block), plain prefill, decodes
    case = build_case([5, 0, 9, 1], [18, 7, 1, 1], H, KVH, Dh=12, dtype=dtype)
    kw = dict(
        block_tables=case["block_tables"].to(DEVICE),
        query_start_loc=case["query_start_loc"].to(DEVICE),
        seq_lens=case["seq_lens"].to(DEVICE), scale=12**-0.5, sliding_window=sliding_window,
    )  # fmt: skip
    q, kc, vc = (case[n].to(DEVICE) for n in ("q", "k_cache", "v_cache"))
    out_ref = paged_attention_ref(q, kc, vc, **kw)
    out = paged_attention_triton(q, kc, vc, **kw)
    assert_close(out, out_ref)
