"""RoPE and the gated activation: twins against transformers' own code, Triton kernels
against the twins."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import assert_close, randn, seeded
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from triton_testing import DEVICE, requires_triton

from ssmserve.kernels.activation import ACTIVATIONS, act_and_mul_ref, act_and_mul_triton
from ssmserve.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton


def rope_case(dtype, head_dim=10, rotary_dim=6, gen_seed=0):
    gen = seeded(gen_seed)
    q = randn(7, 3, head_dim, gen=gen, dtype=dtype)
    k = randn(7, 1, head_dim, gen=gen, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 6, 7, 300, 4095])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    return positions, q, k, inv_freq


@pytest.mark.parametrize("rotary_dim", [10, 6])
def test_rope_twin_matches_transformers(rotary_dim):
    positions, q, k, inv_freq = rope_case(torch.float32, rotary_dim=rotary_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    # transformers' layout: [batch, heads, T, D], rotating the first rotary_dim dims
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(qh[..., :rotary_dim], kh[..., :rotary_dim], cos, sin)
    q_got, k_got = rotary_embedding_ref(positions, q, k, inv_freq)
    assert_close(q_got[..., :rotary_dim], q_ref[0].transpose(0, 1))
    assert_close(k_got[..., :rotary_dim], k_ref[0].transpose(0, 1))
    assert torch.equal(q_got[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gated_activation_twin_matches_transformers(act):
    gen = seeded(1)
    gate_up = randn(5, 2 * 13, gen=gen)
    gate, up = gate_up.split([13, 13], dim=-1)
    assert_close(act_and_mul_ref(gate_up, act=act), ACT2FN[act](gate) * up)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(10, 10), (10, 6), (16, 8)])
def test_rope_triton_matches_twin(dtype, head_dim, rotary_dim):
    args = [t.to(DEVICE) for t in rope_case(dtype, head_dim, rotary_dim, gen_seed=2)]
    for scaling in (1.0, 0.5):
        got = rotary_embedding_triton(*args, scaling=scaling)
        ref = rotary_embedding_ref(*args, scaling=scaling)
        for g, r in zip(got, ref, strict=True):
            assert_close(g, r)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gated_activation_triton_matches_twin(dtype, act):
    gate_up = randn(4, 2 * 37, gen=seeded(3), dtype=dtype).to(DEVICE)
    assert_close(act_and_mul_triton(gate_up, act=act), act_and_mul_ref(gate_up, act=act))


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="act_and_mul supports"):
        act_and_mul_ref(torch.zeros(1, 4), act="mish")


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (10, 6)])
def test_rope_with_the_cache_write_is_rope_then_write_kv(dtype, head_dim, rotary_dim):
    """Given v, the caches and the slots, the rotation writes the rotated k and v into
    the paged caches in the same launch: bit for bit rotary_embedding then
    write_kv_cache (Triton and twins alike), q and k as without the write, a slot of -1
    writing nothing, K/V heads fewer than q's, and k, v slices of one qkv row."""
    from ssmserve.kernels.paged_attention import write_kv_cache_ref, write_kv_cache_triton

    gen = seeded(3)
    T, H, KVH, block_size = 5, 4, 2, 4
    qkv = randn(T, (H + 2 * KVH) * head_dim, gen=gen, dtype=dtype).to(DEVICE)
    q, k, v = (
        t.view(T, -1, head_dim)
        for t in qkv.split([H * head_dim, KVH * head_dim, KVH * head_dim], dim=-1)
    )
    positions = torch.tensor([0, 7, 3, 100, 2], device=DEVICE)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))).to(DEVICE)
    slots = torch.tensor([5, -1, 0, 11, 6], device=DEVICE)
    caches = randn(2, 4, block_size, KVH, head_dim, gen=gen, dtype=dtype).to(DEVICE)
    for rope, write in (
        (rotary_embedding_triton, write_kv_cache_triton),
        (rotary_embedding_ref, write_kv_cache_ref),
    ):
        kc, vc = caches[0].clone(), caches[1].clone()
        q1, k1 = rope(positions, q, k, inv_freq, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
        kc2, vc2 = caches[0].clone(), caches[1].clone()
        q2, k2 = rope(positions, q, k, inv_freq)
        write(k2, v, kc2, vc2, slots)
        assert torch.equal(q1, q2) and torch.equal(k1, k2)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        assert not torch.equal(kc, caches[0])  # something was written


def test_rope_cache_write_needs_all_its_arguments():
    positions, q, k, inv_freq = rope_case(torch.float32)
    with pytest.raises(ValueError, match="all four or none"):
        rotary_embedding_ref(positions, q, k, inv_freq, v=k)
