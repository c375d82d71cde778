"""Gated grouped RMSNorm twin against Hugging Face and a naive grouped version."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close, randn, seeded

from ssmserve.kernels.gated_rms_norm import (
    add_rms_norm_ref,
    embed_rms_norm_ref,
    gated_rms_norm_ref,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gate", [False, True])
def test_matches_hf_bamba_norm_exactly(dtype, with_gate):
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated

    gen = seeded(0)
    x, z = randn(7, 24, gen=gen, dtype=dtype), randn(7, 24, gen=gen, dtype=dtype)
    hf = BambaRMSNormGated(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(24, gen=gen))
        expected = hf(x, z if with_gate else None)
    y = gated_rms_norm_ref(x, hf.weight.detach(), z if with_gate else None, eps=1e-5)
    assert y.dtype == dtype
    assert torch.equal(y, expected)


@pytest.mark.parametrize("group_size", [None, 6, 12])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_grouped_matches_naive(group_size, norm_before_gate):
    gen = seeded(1)
    T, Dm, eps = 5, 24, 1e-6
    x, z, w = randn(T, Dm, gen=gen), randn(T, Dm, gen=gen), randn(Dm, gen=gen)
    y = gated_rms_norm_ref(
        x, w, z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate
    )
    g = group_size or Dm
    h = x.double() if norm_before_gate else x.double() * F.silu(z.double())
    expected = torch.empty(T, Dm, dtype=torch.float64)
    for start in range(0, Dm, g):
        part = h[:, start : start + g]
        expected[:, start : start + g] = part / torch.sqrt((part**2).mean(-1, keepdim=True) + eps)
    expected = expected * w.double()
    if norm_before_gate:
        expected = expected * F.silu(z.double())
    assert_close(y, expected)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm_ref(torch.ones(2, 10), torch.ones(10), eps=1e-5, group_size=4)


@pytest.mark.parametrize(
    ("residual_dtype", "dtype"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32,) * 2],
)
@pytest.mark.parametrize("cast_sum", [True, False])
def test_add_rms_norm_equals_the_add_then_hf_mamba2_norm(residual_dtype, dtype, cast_sum):
    """Bit for bit what a Mamba2 model does: residual + output (in the residual's dtype),
    then the next block's RMSNorm of the sum cast to the weight dtype; or, with
    cast_sum=False, what it ends with: norm_f of that sum as it is (float32 with
    residual_in_fp32), then the cast to the LM head's dtype."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNorm

    gen = seeded(3 if cast_sum else 5)
    out = randn(6, 40, gen=gen, dtype=dtype)
    residual = randn(6, 40, gen=gen, dtype=residual_dtype) * 4
    hf = Mamba2RMSNorm(40, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(40, gen=gen))
        total = residual + out
        expected = hf(total.to(dtype)) if cast_sum else hf(total).to(dtype)
    w = hf.weight.detach()
    y, s = add_rms_norm_ref(out, residual, w, eps=1e-5, cast_sum=cast_sum)
    assert s.dtype == residual_dtype and torch.equal(s, total)
    assert y.dtype == dtype and torch.equal(y, expected)
    if not cast_sum and residual_dtype != dtype:  # the cast before the norm changes it here
        cast_first, _ = add_rms_norm_ref(out, residual, w, eps=1e-5)
        assert not torch.equal(cast_first, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "family, residual_in_fp32", [("mamba", True), ("mamba", False), ("llama", False)]
)
def test_embed_rms_norm_equals_hf_first_block(dtype, family, residual_in_fp32):
    """Bit for bit what HF's Mamba (and Llama, whose blocks start as Bamba's, Jamba's and
    Nemotron-H's do) runs before its first mixer: the embedding, the first block's
    RMSNorm of it in the weight's dtype, and the residual stream started from it (float32
    with residual_in_fp32)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mamba.modeling_mamba import MambaRMSNorm

    gen = seeded(6)
    table = randn(50, 40, gen=gen, dtype=dtype) * 3
    ids = torch.tensor([7, 0, 49, 7, 12, 3])
    hf = {"mamba": MambaRMSNorm, "llama": LlamaRMSNorm}[family](40, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(40, gen=gen))
        hidden = F.embedding(ids, table)
        expected = hf(hidden.to(dtype))
    sum_dtype = torch.float32 if residual_in_fp32 else dtype
    y, s = embed_rms_norm_ref(ids, table, hf.weight.detach(), eps=1e-5, sum_dtype=sum_dtype)
    assert s.dtype == sum_dtype and torch.equal(s, hidden.to(sum_dtype))
    assert y.dtype == dtype and torch.equal(y, expected)
