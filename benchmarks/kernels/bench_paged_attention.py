"""How fast are paged attention (decode and prefill) and the KV-cache write, next to their
floors?

    PYTHONPATH=$PWD python benchmarks/kernels/bench_paged_attention.py           # GPU
    PYTHONPATH=$PWD python benchmarks/kernels/bench_paged_attention.py --tiny    # CPU smoke

Bamba-9B attention dims (32 query heads, 8 KV heads, head dim 128), bf16, the engine's
16-token KV blocks, block tables shuffled so blocks are scattered. Sections:
- accuracy: Triton against the float32 twin (ragged decode batch, a split long context,
  mixed prefill + decode, sliding window, fp16), each decode batch also through the
  prefill path.
- graph: a padded decode batch as the engine's CUDA graphs build it, captured and replayed.
- decode: batch 1 / 64 / 256 x context 1k / 4k / 32k, eager and under graph replay, and
  one batch through the prefill path for comparison.
- prefill: fresh prompts, chunks over a long cached context, decodes mixed with a chunk.
- kv_write: write_kv_cache for a 8k-token prefill and a 64-token decode step.
- sdpa: one fresh prompt (nothing cached) of 128 to 32k tokens through the paged kernel
  and through PyTorch's fused attention (flash / memory-efficient, K/V heads repeated for
  the group, as layers/attention.py runs long fresh prompts): the crossover that layer's
  FUSED_PREFILL_MIN_TOKENS relies on.
- sweep_decode, sweep_prefill: launch parameters of each path (`decode_config=`,
  `prefill_config=`), each checked against the defaults.
Floors: max(bytes / copy rate, causal FLOP / bf16 rate); decode bytes are the K and V the
batch must read.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from bench_common import (
    DEV,
    bench_ms,
    capture,
    environment,
    finish,
    floor_ms,
    log,
    parse_args,
    record_check,
    record_time,
    rel_err,
    run_sections,
)

from ssmserve.kernels._common import pdl_unavailable_reason
from ssmserve.kernels.paged_attention import (
    decode_launch_config,
    paged_attention_ref,
    paged_attention_triton,
    prefill_launch_config,
    write_kv_cache_triton,
)

SECTIONS = (
    "accuracy",
    "graph",
    "decode",
    "prefill",
    "kv_write",
    "sdpa",
    "sweep_decode",
    "sweep_prefill",
)
OPTS = parse_args(__doc__, SECTIONS)
TINY = OPTS.tiny
MAX_KV_BYTES = 20e9  # decode cases whose cache is larger are skipped
# (query heads, KV heads, head dim, KV block size)
H, KVH, DH, BLOCK_SIZE = (8, 2, 12, 4) if TINY else (32, 8, 128, 16)
BATCHES = (1, 3) if TINY else (1, 64, 256)
CONTEXTS = (20, 70) if TINY else (1024, 4096, 32768)


def leading_decodes(q_lens: list[int]) -> int:
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def make_batch(
    ctx_lens: list[int], q_lens: list[int], seed: int = 0, table_width: int | None = None
) -> dict[str, Any]:
    """Random q and paged K/V (bf16); sequence s holds ctx_lens[s] + q_lens[s] tokens."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = max(max(need), table_width or 0)
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=DEV).to(torch.int32)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=DEV)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[at : at + n]
        at += n
    shape = (num_blocks, BLOCK_SIZE, KVH, DH)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=DEV).to(torch.bfloat16)

    return dict(
        q=rand(sum(q_lens), H, DH),
        k_cache=rand(*shape),
        v_cache=rand(*shape),
        block_tables=tables,
        query_start_loc=torch.tensor([0, *q_lens], device=DEV).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        num_decodes=leading_decodes(q_lens),
        ctx_lens=ctx_lens,
        q_lens=q_lens,
    )


def call(fn, b: dict[str, Any], num_decodes: int | None = None, dtype=None, **kw: Any):
    """fn on batch b; num_decodes defaults to the batch's leading one-query sequences."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    return fn(
        cast(b["q"]),
        cast(b["k_cache"]),
        cast(b["v_cache"]),
        block_tables=b["block_tables"],
        query_start_loc=b["query_start_loc"],
        seq_lens=b["seq_lens"],
        scale=DH**-0.5,
        num_decodes=b["num_decodes"] if num_decodes is None else num_decodes,
        **kw,
    )


def floor(b: dict[str, Any]) -> float:
    """K/V read once per KV head, q read and out written (bf16); causal FLOP."""
    ctx, q_lens = b["ctx_lens"], b["q_lens"]
    tokens = sum(c + q for c, q in zip(ctx, q_lens, strict=True))
    nbytes = 2 * tokens * KVH * DH * 2 + 2 * sum(q_lens) * H * DH * 2
    keys_seen = sum(q * c + q * (q + 1) // 2 for c, q in zip(ctx, q_lens, strict=True))
    return floor_ms(nbytes, 4 * keys_seen * H * DH)


def timed_ms(fn) -> float:
    return bench_ms(fn, warmup=10, rep=40)


def graph_ms(fn, calls: int = 1) -> float | None:
    """A call replayed from a CUDA graph (how the engine runs decode): ms per call of a
    graph of `calls` calls in a row. One call a graph times the replay's launch as well,
    which exceeds a batch-1 decode's kernels, so the sweep takes 16."""
    if DEV.type != "cuda":
        return None
    graph, _ = capture(lambda: [fn() for _ in range(calls)])
    ms = timed_ms(graph.replay) / calls
    del graph
    return ms


def accuracy() -> None:
    gen = torch.Generator().manual_seed(1)
    long_ctx = 300 if TINY else 32768 - 1
    mid = 60 if TINY else 4096
    ragged = [0, BLOCK_SIZE - 1, BLOCK_SIZE, long_ctx // 7]
    ragged += torch.randint(1, mid, (5 if TINY else 60,), generator=gen).tolist()
    prefill_ctx, prefill_q = ([0, 9, 30], [7, 20, 5]) if TINY else ([0, 1000, 3000], [777, 500, 64])
    window = 13 if TINY else 1000
    mixed_ctx, mixed_q = ragged[:8] + prefill_ctx, [1] * 8 + prefill_q
    for name, ctx, q_lens, sliding_window, dtype in (
        ("decode ragged", ragged, [1] * len(ragged), None, torch.bfloat16),
        ("decode 1 seq long (split)", [long_ctx], [1], None, torch.bfloat16),
        ("decode ragged fp16", ragged, [1] * len(ragged), None, torch.float16),
        (f"decode ragged window {window}", ragged, [1] * len(ragged), window, torch.bfloat16),
        ("mixed decode + prefill", mixed_ctx, mixed_q, None, torch.bfloat16),
        (f"mixed window {window}", mixed_ctx, mixed_q, window, torch.bfloat16),
    ):
        b = make_batch(ctx, q_lens, seed=len(ctx))
        kw = dict(sliding_window=sliding_window)
        ref = call(paged_attention_ref, b, dtype=torch.float32, **kw)
        errors = {
            "num_decodes set": rel_err(call(paged_attention_triton, b, dtype=dtype, **kw), ref)
        }
        if b["num_decodes"] > 0:
            general = call(paged_attention_triton, b, num_decodes=0, dtype=dtype, **kw)
            errors["all via prefill path"] = rel_err(general, ref)
        record_check(f"{name} ({len(ctx)} seqs)", errors)


def graph() -> None:
    """A batch of 50 decodes padded to 64 rows (slot -1 style padding: one query, seq_len
    1), block tables as wide as 32k tokens, as a captured decode graph sees them."""
    if DEV.type != "cuda":
        log("graph: no GPU, skipped")
        return
    n, size, width = 50, 64, -(-32768 // BLOCK_SIZE)
    ctx = torch.randint(1, 4096, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    real = make_batch(ctx, [1] * n, table_width=width)
    pad = size - n
    padded = dict(real, num_decodes=size, ctx_lens=ctx + [0] * pad, q_lens=[1] * size)
    padded["q"] = torch.cat([real["q"], torch.randn(pad, H, DH, device=DEV).to(real["q"].dtype)])
    padded["block_tables"] = torch.cat([real["block_tables"], real["block_tables"][:pad]])
    padded["query_start_loc"] = torch.arange(size + 1, dtype=torch.int32, device=DEV)
    ones = torch.ones(pad, dtype=torch.int32, device=DEV)
    padded["seq_lens"] = torch.cat([real["seq_lens"], ones])
    eager = call(paged_attention_triton, padded)
    g, out = capture(lambda: call(paged_attention_triton, padded))
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    ref = call(paged_attention_ref, real, dtype=torch.float32)
    errors = {"replay vs eager": rel_err(out, eager), "real rows vs twin": rel_err(out[:n], ref)}
    record_check(f"graph replay, batch {n} padded to {size}, 32k-token tables", errors)
    finite = bool(torch.isfinite(out[n:].float()).all())
    record_check("padding rows finite", {"nonfinite": 0.0 if finite else float("inf")})
    label = f"decode batch {n}->{size} ctx<4k, 32k tables, graph"
    record_time(label, timed_ms(g.replay), floor(padded))


def decode() -> None:
    for batch in BATCHES:
        for ctx in CONTEXTS:
            kv_bytes = 2 * batch * ctx * KVH * DH * 2
            if kv_bytes > MAX_KV_BYTES:
                log(f"decode batch {batch} ctx {ctx}: skipped ({kv_bytes / 1e9:.0f} GB of KV)")
                continue
            b = make_batch([ctx - 1] * batch, [1] * batch)
            fn = lambda b=b: call(paged_attention_triton, b)  # noqa: E731
            cfg = decode_launch_config(batch, KVH, H // KVH, DH, ctx, DEV)
            record_time(f"decode batch {batch} ctx {ctx}", timed_ms(fn), floor(b), config=cfg)
            ms = graph_ms(fn)
            if ms is not None:
                record_time(f"decode batch {batch} ctx {ctx} graph", ms, floor(b), config=cfg)
            if batch == BATCHES[1] and ctx == CONTEXTS[1]:
                fn = lambda b=b: call(paged_attention_triton, b, num_decodes=0)  # noqa: E731
                record_time(
                    f"decode batch {batch} ctx {ctx} via prefill path", timed_ms(fn), floor(b)
                )
            del b


PREFILL_CASES = (
    [
        ("4 x 2k prompts", [0] * 4, [2048] * 4),
        ("2k chunk over 30k context", [30720], [2048]),
        ("8k chunk over 24k context", [24576], [8192]),
        ("mixed 32 decodes 4k + 1k chunk", [4095] * 32 + [3072], [1] * 32 + [1024]),
    ]
    if not TINY
    else [("2 prompts", [0, 10], [23, 17]), ("mixed", [40, 30, 9], [1, 1, 20])]
)


def prefill() -> None:
    cfg = prefill_launch_config(H // KVH, DH)
    for name, ctx, q_lens in PREFILL_CASES:
        b = make_batch(ctx, q_lens)
        ms = timed_ms(lambda b=b: call(paged_attention_triton, b))
        record_time(f"prefill {name}", ms, floor(b), config=cfg)
        del b


def kv_write() -> None:
    for label, tokens in (("prefill", 64 if TINY else 8192), ("decode", 4 if TINY else 64)):
        b = make_batch([0], [tokens])
        k = torch.randn(tokens, KVH, DH, device=DEV).to(torch.bfloat16)
        slots = torch.randperm(b["k_cache"].shape[0] * BLOCK_SIZE, device=DEV)[:tokens]
        fn = lambda b=b, k=k, s=slots: write_kv_cache_triton(k, k, b["k_cache"], b["v_cache"], s)  # noqa: E731
        ms = graph_ms(fn) if DEV.type == "cuda" else timed_ms(fn)
        # k and v read, written into the caches (bf16), and the slot per token
        record_time(
            f"write_kv_cache {label} {tokens} tokens", ms, floor_ms(4 * tokens * KVH * DH * 2)
        )


def sdpa() -> None:
    if DEV.type != "cuda":
        log("sdpa: no GPU (the fused kernels are CUDA only), skipped")
        return
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for L in (128, 256, 512, 1024, 2048, 4096, 8192, 32768):
        b = make_batch([0], [L])
        q = b["q"]
        k = torch.randn(L, KVH, DH, device=DEV).to(q.dtype)
        v = torch.randn_like(k)

        def fused(q=q, k=k, v=v) -> torch.Tensor:
            kr, vr = (t.repeat_interleave(H // KVH, dim=1) for t in (k, v))
            qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, kr, vr))
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=DH**-0.5)

        paged_ms = timed_ms(lambda b=b: call(paged_attention_triton, b))
        fused_ms = timed_ms(fused)
        record_time(f"sdpa fresh prompt {L} tokens: paged kernel", paged_ms, floor(b))
        record_time(f"sdpa fresh prompt {L} tokens: torch fused", fused_ms, floor(b))
        log(f"     fused / paged at {L} tokens: {fused_ms / paged_ms:.2f}")
        del b


def sweep_point(label: str, b: dict[str, Any], expected: torch.Tensor, graphed: bool, **kw):
    fn = lambda: call(paged_attention_triton, b, **kw)  # noqa: E731
    try:
        err = rel_err(fn(), expected)
        ms = (graph_ms(fn, calls=16) if graphed else None) or timed_ms(fn)
    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
        log(f"{label}: failed: {str(exc)[:300]}")
        return
    record_check(f"{label} == defaults", {"out": err})
    record_time(label, ms, floor(b), **kw)


def sweep_decode() -> None:
    # (1, 2048): batch-1 decode after a 2k prompt, where Llama-3-8B's attention took
    # 11.3 µs a layer on the H100 against a 2.8 µs floor (2026-12-06, no PDL).
    # (1, 128): one tile, the path's fixed latency.
    points = [(64, 4096), (8, 4096), (1, 32768), (1, 2048), (1, 128)] if not TINY else [(3, 70)]
    variants = [
        {},
        {"num_stages": 1},
        {"num_stages": 3},
        {"num_warps": 8},
        {"block_n": 32},
        {"block_n": 128, "num_warps": 8},
        {"num_splits": 1},
        {"num_splits": 4},
        {"num_splits": 8},
        {"num_splits": 16},
        {"num_splits": 32},
        {"num_splits": 64},
        {"block_n": 32, "num_splits": 64},
        {"block_n": 32, "num_splits": 4},
        {"block_n": 32, "num_warps": 8},
        {"mask_skip": False},
        {"mask_skip": True},
        {"mask_skip": False, "block_n": 32},
    ]
    # With PDL (as decode graphs launch it on sm_90), each call waits for the one before;
    # prefetch reads the first key tile before that wait.
    pdl_variants = [{}, {"prefetch": True}, {"prefetch": False}, {"num_stages": 2}]
    pdl = DEV.type == "cuda" and pdl_unavailable_reason(DEV) is None
    for batch, ctx in points:
        b = make_batch([ctx - 1] * batch, [1] * batch)
        expected = call(paged_attention_triton, b)
        for override in variants:
            label = f"sweep decode batch {batch} ctx {ctx} {json.dumps(override)}"
            sweep_point(label, b, expected, graphed=True, decode_config=override)
        for override in pdl_variants if pdl else []:
            label = f"sweep decode batch {batch} ctx {ctx} pdl {json.dumps(override)}"
            sweep_point(label, b, expected, graphed=True, decode_config=override, pdl=True)
        del b


def sweep_prefill() -> None:
    variants = [
        {},
        {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2},
        {"block_n": 32},
        {"num_warps": 4},
        {"num_stages": 2},
        {"block_m": 64},
        {"mask_skip": False},
    ]
    for name, ctx, q_lens in PREFILL_CASES[1:3] if not TINY else PREFILL_CASES[1:]:
        b = make_batch(ctx, q_lens)
        expected = call(paged_attention_triton, b)
        for override in variants:
            label = f"sweep prefill {name} {json.dumps(override)}"
            sweep_point(label, b, expected, graphed=False, prefill_config=override)
        del b


def main() -> None:
    environment(
        OPTS,
        dims={"H": H, "KVH": KVH, "Dh": DH, "block_size": BLOCK_SIZE},
        prefill_default_config=prefill_launch_config(H // KVH, DH),
    )
    named = dict(
        accuracy=accuracy,
        graph=graph,
        decode=decode,
        prefill=prefill,
        kv_write=kv_write,
        sdpa=sdpa,
        sweep_decode=sweep_decode,
        sweep_prefill=sweep_prefill,
    )
    run_sections(OPTS, named)
    finish(OPTS, "paged_attention", "Paged attention and KV-cache write")


if __name__ == "__main__":
    main()
