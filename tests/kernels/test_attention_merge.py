"""Merging attention over two disjoint key sets (a prompt chunk's own tokens and its
cached context): the twin against attention over the union computed whole in float64,
the Triton kernel against the twin."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.attention_merge import (
    merge_attention_parts_ref,
    merge_attention_parts_triton,
)


def part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Attention of q [H, L, D] over k, v [H, n, D] (mask [L, n] True = seen) in float64:
    the output and each row's logsumexp of its scaled scores."""
    scores = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v.double(), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_equals_attention_over_the_union(dtype):
    """A chunk of L = 5 queries after 7 context tokens, lower-right causal: the merge of
    the context part (unmasked) and the own part (causal) is the attention over all 12
    keys with the query i seeing keys up to 7 + i."""
    gen = seeded(0)
    H, L, context, D = 3, 5, 7, 8
    q, k, v = (randn(H, n, D, gen=gen, scale=2.0) for n in (L, context + L, context + L))
    n = context + L
    whole_mask = torch.arange(n)[None, :] <= context + torch.arange(L)[:, None]
    whole, _ = part(q, k, v, whole_mask)
    own, lse_own = part(q, k[:, context:], v[:, context:], torch.ones(L, L).tril().bool())
    ctx, lse_ctx = part(q, k[:, :context], v[:, :context], None)
    merged = merge_attention_parts_ref(
        own[None].to(dtype), lse_own[None].float(), ctx[None].to(dtype), lse_ctx[None].float()
    )
    assert merged.dtype == dtype and merged.shape == (1, H, L, D)
    # The parts rounded to dtype, then merged in float32: within dtype's tolerance.
    assert_close(merged[0], whole, dtype=dtype)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L, D", [(5, 8), (70, 24)])
def test_triton_matches_twin_on_cudnn_layouts(dtype, L, D):
    """Outputs laid out as cuDNN gives them for a [L, H, D] chunk ([1, H, L, D] views of
    [L, H, D] memory), logsumexps [1, H, L] of a strided buffer; D not a power of two and
    L past one row block in the second case; the output keeps own's layout."""
    gen = seeded(1)
    H = 3
    own = randn(L, H, D, gen=gen, dtype=dtype).transpose(0, 1)[None].to(DEVICE)
    ctx = randn(L, H, D, gen=gen, dtype=dtype).transpose(0, 1)[None].to(DEVICE)
    lse = randn(1, H, L, 2, gen=gen, scale=4.0).to(DEVICE)
    lse_own, lse_ctx = lse[..., 0], lse[..., 1]
    got = merge_attention_parts_triton(own, lse_own, ctx, lse_ctx)
    want = merge_attention_parts_ref(own, lse_own, ctx, lse_ctx)
    assert got.stride() == own.stride()
    # The twin rounds once from float32 too: the two differ by float32 arithmetic order.
    assert_close(got, want, dtype=torch.float32 if dtype == torch.float32 else dtype)


def test_bad_arguments_are_refused():
    x = torch.zeros(1, 2, 3, 4)
    lse = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="ctx must have shape"):
        merge_attention_parts_ref(x, lse, torch.zeros(1, 2, 4, 4), lse)
    with pytest.raises(ValueError, match="must be float32"):
        merge_attention_parts_ref(x, lse.double(), x, lse)
    with pytest.raises(ValueError, match="share a dtype"):
        merge_attention_parts_ref(x, lse, x.bfloat16(), lse)
