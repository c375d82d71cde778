"""Compiled kernel variants do not follow the batch (docs/kernels.md, "Compilation per
batch shape").

Triton compiles a kernel once per compile key: its constexpr values, its arguments' types
and specialisations (integers equal to 1 or divisible by 16, pointers 16-byte aligned) and
its launch options. `record_compile_keys` collects the keys `LazyKernel` launches under,
computed as compiled Triton computes them, also when the kernels run in the interpreter.
Over steps of 1 to 9 sequences with varied token counts, each kernel must see at most the
few keys its launch paths and features explain (BOUNDS), none that the batch's size or
make-up adds.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import cu_seqlens_of, randn, seeded
from triton_testing import DEVICE, requires_triton

from ssmserve import LLM, SamplingParams
from ssmserve.kernels._common import record_compile_keys
from ssmserve.kernels.moe import fused_moe_triton, moe_route_triton
from ssmserve.kernels.paged_attention import paged_attention_triton
from ssmserve.kernels.selective_scan import selective_scan_varlen_triton
from ssmserve.layers.batch import ForwardBatch
from tests.tiny_models import make_tiny_checkpoint

pytestmark = requires_triton

# A tiny Bamba whose row widths are multiples of 16 elements, as in the real models
# (Bamba-9B: in_proj 16768, conv 8448, heads x head dim 8192). Views of a one-token batch
# get torch's contiguous strides (x.view(1, H, P) has stride H * P, not the parent's row);
# with such widths both are multiples of 16, so they specialise alike.
ALIGNED_BAMBA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    attn_layer_indices=[1],
    num_attention_heads=4,
    num_key_value_heads=2,
    mamba_n_heads=16,
    mamba_d_head=8,
    mamba_d_state=16,
)

# Keys a kernel may have over any batches, and why; every other kernel has one.
BOUNDS = {
    # prefill path and decode path (each with its own tuned tiles and warps), the decode
    # path of a decode step with RoPE and the K/V write inside, and, at longer contexts,
    # the decode paths with the context split over programs
    "_paged_attention_kernel": 3,
    # with and without prefix-cache snapshots in the step (the layout kernel maps chunks
    # to their snapshot rows, the scan kernel writes them)
    "_ssd_chunk_cumsum_kernel": 2,
    "_ssd_chunk_scan_kernel": 2,
    # the mixer's gated norm and the plain RMSNorms: two call sites, model constants
    "_gated_rms_norm_kernel": 2,
    # the residual add and norm between blocks, and the first block's norm gathering the
    # embedding (EMBED; the ids sit at a fixed offset of the packed step, so always aligned)
    "_add_rms_norm_kernel": 2,
    # few programs (2 warps, 16-token blocks) or many, on the GPU; x snapshots or none
    "_selective_scan_kernel": 4,
    # the launch table's three rows (decode, mid, prefill rows per expert)
    "_moe_up_kernel": 3,
    "_moe_down_kernel": 3,
    # the expert alignment's block_m, one per launch-table row
    "_align_kernel": 3,
    # channels a program, 256 halved down to 32 while few rows leave SMs idle: at most
    # four tiles whatever the batch (update_block_c)
    "_conv1d_update_kernel": 4,
    # the sampler's draw: greedy rows, or temperature draws with their noise
    "_draw_chunks_kernel": 2,
}


def assert_within_bounds(keys: dict[str, set[str]]) -> None:
    over = {name: len(k) for name, k in keys.items() if len(k) > BOUNDS.get(name, 1)}
    assert not over, f"kernels compiled once per batch shape: {over}"


def test_model_steps_of_any_batch_reuse_compiled_kernels(tmp_path, monkeypatch):
    """A hybrid model over prefill, decode and mixed steps of 1 to 9 sequences, chunked
    prompts resumed mid-chunk, and prefix-cache hits: no kernel compiles per batch."""
    path = make_tiny_checkpoint(str(tmp_path), "bamba", seed=0, **ALIGNED_BAMBA)
    shapes = set()
    from_packed = ForwardBatch.from_packed

    def recording_from_packed(*args, **kwargs):
        batch = from_packed(*args, **kwargs)
        shapes.add((batch.num_decodes, batch.num_seqs, batch.num_tokens))
        return batch

    monkeypatch.setattr(ForwardBatch, "from_packed", recording_from_packed)
    llm = LLM(
        path,
        kernel_backend="triton",
        device=str(DEVICE),
        dtype="float32",
        enforce_eager=True,
        cache_memory=2**27,
        max_num_batched_tokens=40,
    )
    # 9 prompts of 3 to 19 tokens, prefilled over steps of a 40-token budget (some split
    # mid-chunk), then decoded in batches of 9 down to 1 as they finish.
    prompts = [[5 + (3 * i + j) % 50 for j in range(3 + 2 * i)] for i in range(9)]
    params = [SamplingParams(max_tokens=3 + i // 2, ignore_eos=True) for i in range(9)]
    with record_compile_keys() as keys:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # Shared prefixes: prompts resumed from cached states, snapshots written again.
        again = [{"prompt_token_ids": p + [7, 8, 9]} for p in prompts[6:]]
        llm.generate(again, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    sizes = {num_seqs for _, num_seqs, _ in shapes}
    assert {1, 9} <= sizes and len(shapes) >= 10, sorted(shapes)
    assert any(0 < nd < num_seqs for nd, num_seqs, _ in shapes), "no mixed step"
    names = ("_ssd_chunk_cumsum_kernel", "_conv1d_varlen_kernel", "_state_update_kernel")
    for name in (*names, "_mamba2_decode_kernel"):  # one-sequence decodes fuse
        assert name in keys
    assert_within_bounds(keys)


def test_attention_decode_splits_of_any_batch_share_one_kernel():
    """Decode batches of 1 to 9 sequences, their contexts split over 1 to 32 programs."""
    gen = seeded(0)
    H, KVH, Dh, block_size, num_blocks = 4, 2, 16, 16, 48
    k_cache = randn(num_blocks, block_size, KVH, Dh, gen=gen).to(DEVICE)
    v_cache = randn(num_blocks, block_size, KVH, Dh, gen=gen).to(DEVICE)
    splits = set()
    with record_compile_keys() as keys:
        for batch, context in [(1, 640), (1, 200), (2, 330), (3, 120), (5, 40), (9, 20)]:
            width = -(-context // block_size)
            tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
            cfg = dict(num_splits=max(1, min(64, context // 20 // batch)))
            splits.add(cfg["num_splits"])
            paged_attention_triton(
                randn(batch, H, Dh, gen=gen).to(DEVICE),
                k_cache,
                v_cache,
                block_tables=(tables % num_blocks).to(DEVICE),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
                scale=Dh**-0.5,
                num_decodes=batch,
                decode_config=cfg,
            )
    assert len(splits) >= 5
    # Split and unsplit decode, each with one or two pipeline stages (by the tiles a split
    # has at the longest context): a few variants, not one per batch.
    assert len(keys["_paged_attention_kernel"]) <= 4
    assert len(keys["_merge_splits_kernel"]) == 1


@pytest.mark.parametrize("snapshots", [False, True])
def test_selective_scan_of_any_batch_shares_one_kernel(snapshots):
    """Mamba1's scan over 1 to 9 sequences of 1 to 23 tokens."""
    gen = seeded(1)
    Dm, N, num_slots = 16, 4, 20
    A = -torch.exp(randn(Dm, N, gen=gen)).to(DEVICE)
    state = torch.zeros(num_slots, Dm, N, device=DEVICE)
    with record_compile_keys() as keys:
        for lengths in ([1], [2, 3], [5, 1, 7], [4] * 5, [1, 2, 3, 4, 5, 6, 7, 8, 23]):
            S, T = len(lengths), sum(lengths)
            extra = {}
            if snapshots:
                extra = dict(
                    snapshot_seqs=torch.tensor([0], device=DEVICE),
                    snapshot_lens=torch.tensor([1], device=DEVICE),
                    snapshot_slots=torch.tensor([num_slots - 1], device=DEVICE),
                )
            selective_scan_varlen_triton(
                *(randn(T, Dm, gen=gen).to(DEVICE) for _ in range(2)),
                A,
                *(randn(T, N, gen=gen).to(DEVICE) for _ in range(2)),
                None,
                cu_seqlens=cu_seqlens_of(lengths).to(DEVICE),
                ssm_state=state,
                state_slots=torch.arange(S, device=DEVICE),
                has_initial_state=torch.ones(S, dtype=torch.bool, device=DEVICE),
                **extra,
            )
    few_programs_tuning = 2 if DEVICE == "cuda" else 1
    assert len(keys["_selective_scan_kernel"]) <= few_programs_tuning


def test_moe_of_any_batch_keeps_to_its_launch_table():
    """Mixture of experts over 1 to 40 tokens: one kernel per launch-table row of the
    sorted path, one for each of the per-assignment kernels and the router's top-k."""
    gen = seeded(2)
    H, I, E, K = 16, 16, 4, 2
    w13 = randn(E, 2 * I, H, gen=gen).to(DEVICE)
    w2 = randn(E, H, I, gen=gen).to(DEVICE)
    with record_compile_keys() as keys:
        for T in (1, 2, 3, 5, 9, 16, 40):
            weights, ids = moe_route_triton(randn(T, E, gen=gen).to(DEVICE), top_k=K)
            fused_moe_triton(randn(T, H, gen=gen).to(DEVICE), w13, w2, weights, ids)
    assert_within_bounds(keys)
