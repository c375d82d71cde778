"""Checks every model family passes, against independent references (CPU, float32).

A family's test file builds its tiny checkpoints (tests/tiny_models.py style: fixed
seed, `save_pretrained`; `tiny_checkpoints` in a module-scoped fixture) and calls these:

- `check_matches_transformers`: greedy tokens equal a greedy loop over transformers'
  *full forward* (no KV/state cache, so HF's cached decode path cannot hide or add
  bugs), chosen-token logprobs within 1e-4, and prompt logprobs equal transformers'
  teacher-forced log-softmax.
- `check_engine_invariants`: any token budget down to 1, batch composition and arrival
  order, forced preemption (attention models), abort; nothing allocated afterwards; and
  `check_prefix_caching`.
- `check_prefix_caching`: cached equals uncached on prompts sharing prefixes, a repeated
  prompt hits all but its last token, a follow-up turn the conversation so far.
- `check_tensor_parallel`: TP=size equals TP=1 (tokens, logprobs within float32 noise).
- `check_triton_matches_torch`: the Triton kernels (under TRITON_INTERPRET=1 on CPU) give
  the PyTorch twins' tokens and logprobs, with chunked prefill and decode in a batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ssmserve import LLM, SamplingParams
from tests.tiny_models import make_tiny_checkpoint

LOGPROB_TOL = 1e-4


def tiny_checkpoints(tmp_path_factory, family: str, variants: dict[str, dict]) -> Callable:
    """checkpoint(name) -> folder of the tiny `family` checkpoint with the config overrides
    variants[name], built on first use (seed 0)."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            path = str(tmp_path_factory.mktemp(f"{family}_{name}"))
            built[name] = make_tiny_checkpoint(path, family, seed=0, **variants[name])
        return built[name]

    return get


def hf_model(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by re-running the full forward each step (use_cache=False)."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        lps = torch.log_softmax(logits, -1)
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(lps[token]))
        ids.append(token)
    return tokens, logprobs


@torch.no_grad()
def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, teacher-forced."""
    logits = model(input_ids=torch.tensor([prompt_ids]), use_cache=False).logits[0].float()
    lps = torch.log_softmax(logits[:-1], -1)
    return lps.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1).tolist()


def token_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in lengths]


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


def check_matches_transformers(
    path: str, prompts: list[str], max_tokens: int = 16, min_distinct: int = 8
) -> None:
    model = hf_model(path)
    llm = LLM(path, device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    distinct: set[int] = set()
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        ids = tok(prompt).input_ids
        ref_tokens, ref_lps = hf_greedy(model, ids, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{path}: {prompt!r}"
        for i, (t, ref) in enumerate(zip(got.token_ids, ref_lps, strict=True)):
            assert abs(got.logprobs[i][t].logprob - ref) < LOGPROB_TOL, (prompt, i)
        ref_prompt = hf_prompt_logprobs(model, ids)
        got_prompt = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        torch.testing.assert_close(
            torch.tensor(got_prompt), torch.tensor(ref_prompt), atol=LOGPROB_TOL, rtol=0
        )
        distinct.update(ref_tokens)
    # A checkpoint whose greedy output is one repeated token proves little.
    assert len(distinct) >= min_distinct, f"{path}: degenerate model ({len(distinct)} tokens)"
    assert_idle(llm)


def check_engine_invariants(path: str, has_attention: bool, vocab: int = 300) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = token_prompts(vocab, [1, 5, 17, 33], seed=3)
    base = LLM(path, device="cpu", dtype="float32")
    alone = [base.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in base.generate(prompts[::-1], greedy)][::-1]
    assert together == alone, "batch composition or arrival order changed an output"
    for budget in (1, 3, 7):
        llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=budget)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone, budget
        assert_idle(llm)
    if has_attention:
        # 12 blocks of 4 tokens hold one 43-token request but not all four at once.
        llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=12, block_size=4)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == alone
        assert llm.stats()["num_preemptions"] > 0
        assert_idle(llm)
    engine = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=4).llm_engine
    engine.add_request("doomed", prompts[3], greedy)
    engine.add_request("kept", prompts[2], greedy)
    for _ in range(5):
        engine.step()
    engine.abort_request("doomed")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["kept"].outputs[0].token_ids == alone[2]
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0, stats
    check_prefix_caching(path, vocab)


def check_prefix_caching(path: str, vocab: int = 300) -> None:
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=0, ignore_eos=True)
    rng = random.Random(11)
    stem = [rng.randrange(1, vocab) for _ in range(40)]
    prompts = [stem[:37] + [3, 4, 5], stem, stem[:20] + [6, 7], stem]
    ref = LLM(path, device="cpu", dtype="float32", enable_prefix_caching=False)
    llm = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=7)
    outs = []
    for prompt in prompts:  # one at a time: each finds what the earlier ones left
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        want = ref.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, prompt
        for i, t in enumerate(want.outputs[0].token_ids):
            a, b = got.outputs[0].logprobs[i][t].logprob, want.outputs[0].logprobs[i][t].logprob
            # Resumed and whole prefills sum in a different order: float32 noise only.
            assert abs(a - b) <= LOGPROB_TOL, (len(prompt), i, a, b)
        outs.append(got)
    assert outs[3].num_cached_tokens == len(stem) - 1, "a repeated prompt hits all but one"
    turn2 = stem + outs[1].outputs[0].token_ids + [8, 9]
    follow = llm.generate([{"prompt_token_ids": turn2}], params, use_tqdm=False)[0]
    expected = ref.generate([{"prompt_token_ids": turn2}], params, use_tqdm=False)[0]
    assert follow.outputs[0].token_ids == expected.outputs[0].token_ids
    assert follow.num_cached_tokens >= len(stem) + 5 - 1, "a follow-up turn hits the last one"
    assert_idle(llm)
    assert llm.reset_prefix_cache()


def check_tensor_parallel(
    path: str, prompts: list[str], size: int = 2, rel_tol: float = 1e-5
) -> None:
    check_parallel(path, prompts, tp=size, rel_tol=rel_tol)


def check_parallel(
    path: str,
    prompts: list[str],
    tp: int = 1,
    pp: int = 1,
    partition: str | None = None,
    rel_tol: float = 1e-5,
) -> None:
    """TP x PP equals one process at the same token budget: same greedy tokens, chosen
    logprobs within float32 noise (all-reduced partial sums and batches made of other
    micro-batches round differently)."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)
    ref = LLM(path, device="cpu", max_num_batched_tokens=5).generate(prompts, params)
    llm = LLM(
        path,
        device="cpu",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pp_layer_partition=partition,
        max_num_batched_tokens=5,
    )
    try:
        got = llm.generate(prompts, params)
        for r, g in zip(ref, got, strict=True):
            assert g.outputs[0].token_ids == r.outputs[0].token_ids
            for i, t in enumerate(r.outputs[0].token_ids):
                a, b = r.outputs[0].logprobs[i][t].logprob, g.outputs[0].logprobs[i][t].logprob
                assert abs(a - b) <= rel_tol * max(1.0, abs(a)), (i, a, b)
        assert_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def check_triton_matches_torch(path: str, prompts: list[str], max_tokens: int = 4) -> None:
    """Set TRITON_INTERPRET=1 first on CPU (the interpreter is slow: keep this short)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
    ref = LLM(path, device="cpu", kernel_backend="torch").generate(prompts, params)
    llm = LLM(path, device="cpu", kernel_backend="triton", max_num_batched_tokens=5)
    for r, g in zip(ref, llm.generate(prompts, params), strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for i, t in enumerate(r.outputs[0].token_ids):
            a, b = r.outputs[0].logprobs[i][t].logprob, g.outputs[0].logprobs[i][t].logprob
            assert abs(a - b) < LOGPROB_TOL, (i, a, b)
    assert_idle(llm)
