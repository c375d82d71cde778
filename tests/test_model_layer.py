"""The model layer's sharding rules, against whole-matrix references on simulated ranks,
and the loader's and mixers' refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ssmserve import LLM, SamplingParams
from ssmserve.distributed.parallel import TensorParallel
from ssmserve.layers.embed import VocabParallelEmbedding
from ssmserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ssmserve.layers.mamba2_mixer import Mamba2Shard


def ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank=r, size=size) for r in range(size)]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_merged_column_shards_concatenate_to_the_whole_product(size):
    gen = torch.Generator().manual_seed(0)
    gate, up, x = (torch.randn(s, generator=gen) for s in ((7, 5), (7, 5), (4, 5)))
    whole_gate, whole_up = F.linear(x, gate), F.linear(x, up)
    parts = []
    for tp in ranks(size):
        layer = ColumnParallelLinear.even(5, [7, 7], tp)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        parts.append(layer(x).split(layer.output_sizes, dim=-1))
    torch.testing.assert_close(torch.cat([g for g, _ in parts], -1), whole_gate)
    torch.testing.assert_close(torch.cat([u for _, u in parts], -1), whole_up)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_row_parallel_partial_products_sum_to_the_whole_product(size):
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(6, 10, generator=gen), torch.randn(3, 10, generator=gen)
    total = torch.zeros(3, 6)
    for tp in ranks(size):
        layer = RowParallelLinear(10, 6, tp)
        layer.weight.weight_loader(layer.weight, weight)
        cols = layer.weight.columns.rows
        total += F.linear(x[:, cols.start : cols.stop], layer.weight)
    torch.testing.assert_close(total, F.linear(x, weight))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"), [(6, 2, 2), (6, 1, 3), (4, 2, 4), (6, 3, 3)]
)
def test_qkv_shards_hold_the_kv_heads_their_query_heads_read(heads, kv_heads, size):
    head_dim, hidden = 3, 4
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(heads * head_dim, hidden, generator=gen)
    k = torch.randn(kv_heads * head_dim, hidden, generator=gen)
    for tp in ranks(size):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp)
        layer.weight.weight_loader(layer.weight, q, 0)
        layer.weight.weight_loader(layer.weight, k, 1)
        layer.weight.weight_loader(layer.weight, k, 2)
        local_q, local_k, _ = layer.weight.split(layer.output_sizes)
        per_kv = layer.num_local_heads // layer.num_local_kv_heads
        for j, h in enumerate(layer.q_heads):
            torch.testing.assert_close(
                local_q.view(-1, head_dim, hidden)[j], q.view(-1, head_dim, hidden)[h]
            )
            g = h // (heads // kv_heads)  # the KV head query head h reads
            torch.testing.assert_close(
                local_k.view(-1, head_dim, hidden)[j // per_kv], k.view(-1, head_dim, hidden)[g]
            )


@pytest.mark.parametrize(
    ("heads", "groups", "size"), [(6, 3, 2), (6, 1, 3), (8, 4, 2), (12, 3, 4), (7, 7, 3)]
)
def test_mamba2_shard_gives_each_local_head_its_group(heads, groups, size):
    covered = []
    for tp in ranks(size):
        shard = Mamba2Shard.plan(heads, groups, tp)
        per_local_group = len(shard.heads) // len(shard.groups)
        for j, h in enumerate(shard.heads):
            assert shard.groups[j // per_local_group] == h // (heads // groups)
        covered.extend(shard.heads)
    assert covered == list(range(heads))


def test_vocab_parallel_embedding_pads_and_looks_up_every_id():
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(11, 4, generator=gen)
    ids = torch.arange(11)
    rows = []
    for tp in ranks(3):
        emb = VocabParallelEmbedding(11, 4, tp)
        emb.weight.weight_loader(emb.weight, table, None)
        assert emb.weight.shape[0] == 4  # 11 padded to 12
        rows.append(emb.weight)
    padded = torch.cat(rows)
    torch.testing.assert_close(padded[:11], table)
    assert torch.count_nonzero(padded[11:]) == 0
    torch.testing.assert_close(F.embedding(ids, padded), table)


def test_a_missing_fused_shard_is_named_as_the_checkpoint_names_it(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("llama"), tmp_path / "llama")
    weights = load_file(path / "model.safetensors")
    weights.pop("model.layers.1.self_attn.k_proj.weight")
    weights.pop("model.layers.0.mlp.up_proj.weight")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        LLM(str(path), device="cpu")
    message = str(info.value)
    assert "model.layers.1.self_attn.k_proj.weight" in message
    assert "model.layers.0.mlp.up_proj.weight" in message
    assert "q_proj" not in message and "gate_proj" not in message


def test_an_ssm_activation_the_kernels_lack_is_refused(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("mamba2"), tmp_path / "act")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_act = 'gelu'"):
        LLM(str(path), device="cpu")


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (3, 1)])
def test_attention_over_gathered_context_equals_a_naive_loop(heads, kv_heads, monkeypatch):
    """A prompt chunk with cached context through the fused path's gather (blocks in a
    scrambled order, a partial last block, a few KV heads per call) and lower-right causal
    mask: each query sees exactly the tokens up to its own position."""
    from ssmserve.layers import attention as attention_module
    from ssmserve.layers.cache import KVCache
    from tests.tiny_models import make_attention

    gen = torch.Generator().manual_seed(4)
    D, block_size, n, L = 8, 4, 23, 9  # 14 cached tokens, 9 new; 6 blocks, the last partial
    layer = make_attention(heads, kv_heads, D, scale=0.3)
    k_cache = torch.randn(10, block_size, kv_heads, D, generator=gen)
    v_cache = torch.randn(10, block_size, kv_heads, D, generator=gen)
    table = torch.tensor([7, 2, 9, 0, 5, 3, 8, 1], dtype=torch.int32)  # wider than needed
    q = torch.randn(L, heads, D, generator=gen)
    # One KV head per call when the budget allows no more.
    monkeypatch.setattr(attention_module, "FUSED_CONTEXT_MAX_BYTES", 1)
    out = layer._fused_with_context(q, KVCache(k_cache, v_cache), table, n)
    keys = k_cache[table.long()].flatten(0, 1)[:n].double()
    values = v_cache[table.long()].flatten(0, 1)[:n].double()
    groups = heads // kv_heads
    for i in range(L):
        for h in range(heads):
            seen = n - L + i + 1
            scores = keys[:seen, h // groups] @ q[i, h].double() * 0.3
            expected = scores.softmax(0) @ values[:seen, h // groups]
            assert torch.allclose(out[i, h].double(), expected, atol=1e-5), (i, h)


def test_cache_copies_move_rows_of_every_layer_through_the_stacks():
    """Caches of one kind and shape are views into one stack, each contiguous and apart,
    and a step's copies (saves, restores, KV blocks) move the same rows in every layer as
    a per-layer loop of row copies does."""
    from ssmserve.layers.batch import CacheCopies
    from ssmserve.layers.cache import (
        KVCacheSpec,
        LayerCacheSpec,
        StateSpec,
        allocate_caches,
        apply_cache_copies,
    )

    ssm_a, ssm_b = StateSpec((6, 3), (2, 4, 5)), StateSpec((10, 3), (3, 4, 5))
    kv = KVCacheSpec(num_kv_heads=2, head_dim=4)
    specs = [
        LayerCacheSpec(state=ssm_a),
        LayerCacheSpec(kv=kv),
        LayerCacheSpec(state=ssm_b),
        LayerCacheSpec(kv=kv, state=ssm_a),
        LayerCacheSpec(state=ssm_a),
    ]

    def allocate(specs, num_kv_blocks, num_state_slots, dtype, state_dtype):
        return allocate_caches(
            specs,
            num_kv_blocks=num_kv_blocks,
            block_size=4,
            num_state_slots=num_state_slots,
            dtype=dtype,
            state_dtype=state_dtype,
            device=torch.device("cpu"),
        )

    caches, stacks = allocate(specs, 7, 9, torch.float32, torch.float64)
    tensors = [t for c in caches for part in (c.kv, c.state) if part for t in part[:2]]
    assert all(t.is_contiguous() for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == len(tensors)
    assert caches[0].state.ssm.shape == (9, 2, 4, 5) and caches[0].state.ssm.dtype == torch.float64
    assert caches[2].state.conv.shape == (9, 10, 3) and caches[1].kv.k.shape == (7, 4, 2, 4)
    # Two conv shapes, two SSM state shapes and one KV shape: 5 stacks for 12 tensors.
    assert len(stacks) == 5
    gen = torch.Generator().manual_seed(0)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
    expected = [t.clone() for t in tensors]
    idx = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    copies = CacheCopies(
        save_slots=idx(0, 2),
        save_rows=idx(7, 8),
        restore_rows=idx(8, 5),
        restore_slots=idx(1, 3),
        block_sources=idx(2, 6),
        block_destinations=idx(0, 1),
    )
    for t in expected:
        kind = "kv" if t.shape[0] == 7 else "state"
        moves = [("state", copies.save_slots, copies.save_rows)]
        moves += [("state", copies.restore_rows, copies.restore_slots)]
        moves += [("kv", copies.block_sources, copies.block_destinations)]
        for move_kind, src, dst in moves:
            if move_kind == kind:
                for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                    t[d] = t[s].clone()
    apply_cache_copies(stacks, copies)
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(got, want)
    # Each view starts 256 bytes apart or a multiple, as allocations of their own would.
    odd_specs = [LayerCacheSpec(state=StateSpec((5, 3), (1, 1, 3)))] * 3
    odd = allocate(odd_specs, 0, 3, torch.bfloat16, torch.float32)
    for _, stack in odd.stacks:
        offsets = [view.data_ptr() - stack.data_ptr() for view in stack.unbind(0)]
        assert offsets[1] > 0 and all(offset % 256 == 0 for offset in offsets)


@pytest.mark.parametrize("variant", ["bamba", "llama"])
def test_a_decode_graphs_batch_takes_its_hidden_rows_as_its_logits_rows(checkpoint, variant):
    """A decode graph's batch (`decode_prefix`) skips the logits gather only when its
    logits rows are 0..n-1, and its logits are then the gathered rows' logits (the
    forward over the same batch with the gather)."""
    from ssmserve.layers.batch import ForwardBatch, StepInputs

    llm = LLM(checkpoint(variant), dtype="float32", cache_memory=2**24)
    runner = llm.llm_engine.executor.runner
    n = 4

    def batch(rows: list[int]) -> ForwardBatch:
        # Four one-token sequences on state slot -1 and KV slot -1: they touch no cache.
        inputs = StepInputs(logits_indices=rows, num_decodes=n)
        for i in range(n):
            inputs.add_sequence([5 + 7 * i], 1, [], runner.block_size, None)
        inputs.block_tables = [[0]] * n
        return ForwardBatch.from_packed(inputs.pack(), runner.device)

    in_order, swapped = batch(list(range(n))), batch([1, 0, 2, 3])
    assert not in_order.all_logits  # a step's batch always gathers
    graph_batch = in_order.decode_prefix(n)
    assert graph_batch.all_logits and not swapped.decode_prefix(n).all_logits
    expected = runner.forward_logits(in_order)
    torch.testing.assert_close(runner.forward_logits(graph_batch), expected, rtol=0, atol=0)
    # The rows differ from one another: a gather that reordered them would show.
    assert not torch.equal(expected[0], expected[1])
    torch.testing.assert_close(runner.forward_logits(swapped), expected[[1, 0, 2, 3]])


@pytest.mark.parametrize("variant", ["mamba", "mamba2", "llama", "bamba"])
def test_the_first_block_embeds_in_its_norms_launch(checkpoint, variant, monkeypatch):
    """On one rank a Mamba model's first block, or a PreNormBlock model's, gathers the
    embedding in its norm's kernel (`embed_rms_norm`, no embedding forward of its own),
    and its logits are the separate embedding, norm (and float32 copy)'s: bit for bit
    where the twins run (the CPU); on a GPU the fused and the separate launches are
    different compiled kernels, whose float32 sums may round apart in the last bit."""
    from ssmserve.models.base import CausalLM
    from ssmserve.models.mamba import MambaStyleLM

    # No prefix caching: the second run must compute the same steps, not resume the
    # first's prompts (a resumed prompt's matmuls round otherwise). Eager: decode graphs
    # captured at start would replay the fused path in the second run too.
    llm = LLM(
        checkpoint(variant),
        dtype="float32",
        cache_memory=2**24,
        enable_prefix_caching=False,
        enforce_eager=True,
    )
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    prompts = [{"prompt_token_ids": [3, 17, 9, 40, 2]}, {"prompt_token_ids": [11, 5]}]

    def embedding_forward(self, ids):
        raise AssertionError("the fused first block should gather the embedding")

    with monkeypatch.context() as patch:
        patch.setattr(VocabParallelEmbedding, "forward", embedding_forward)
        fused = llm.generate(prompts, params)
    for cls in (CausalLM, MambaStyleLM):
        monkeypatch.setattr(cls, "embeds_in_first_norm", lambda self: False)
    apart = llm.generate(prompts, params)
    exact = llm.llm_engine.device.type == "cpu"
    for a, b in zip(fused, apart, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        fused_lp, apart_lp = a.outputs[0].cumulative_logprob, b.outputs[0].cumulative_logprob
        assert fused_lp == apart_lp if exact else abs(fused_lp - apart_lp) < 1e-5
