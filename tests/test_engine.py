"""Engine invariants (DESIGN.md): chunking, batch composition, arrival order and
preemption never change a request's greedy output; aborts and finishes free everything."""

from __future__ import annotations

import random

import pytest

from ssmserve import LLM, SamplingParams
from ssmserve.config import EngineConfig
from ssmserve.engine.engine import InvalidRequestError, LLMEngine

FAMILIES = ["bamba", "bamba_attn_first_last_mqa", "mamba2", "mamba", "llama"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def token_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in lengths]


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", dtype="float32", **kwargs)


def alone(llm: LLM, prompts: list[dict], params=GREEDY) -> list[list[int]]:
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def assert_idle(stats: dict) -> None:
    assert stats["kv_blocks_used"] == 0, stats
    assert stats["state_slots_used"] == 0, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


@pytest.fixture(scope="module")
def references(checkpoint):
    """family -> (prompts, outputs of each prompt run alone with default settings)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            llm = make_llm(checkpoint(family))
            prompts = token_prompts(llm.get_tokenizer().vocab_size, [1, 5, 17, 33, 40])
            cache[family] = (prompts, alone(llm, prompts))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [1, 2, 3, 7, 16, 61, None])
def test_any_chunking_equals_no_chunking(checkpoint, references, family, budget):
    prompts, expected = references(family)
    llm = make_llm(checkpoint(family), max_num_batched_tokens=budget)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_idle(llm.stats())


@pytest.mark.parametrize("family", ["bamba", "mamba2", "mamba", "llama"])
def test_batch_of_lengths_1_to_100_equals_alone(checkpoint, family):
    llm = make_llm(checkpoint(family))
    prompts = token_prompts(llm.get_tokenizer().vocab_size, list(range(1, 101)), seed=1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert batched == alone(llm, prompts, params)
    assert_idle(llm.stats())


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_arriving_mid_flight(checkpoint, references, family):
    prompts, expected = references(family)
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint(family), device="cpu", dtype="float32", max_num_batched_tokens=9
        )
    )
    finished = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        # Add a new request every third step, whatever the others are doing.
        if pending and step % 3 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert [finished[i] for i in range(len(prompts))] == expected
    assert_idle(engine.stats())


@pytest.mark.parametrize("family", ["bamba", "bamba_attn_first_last_mqa", "llama"])
def test_preemption_changes_no_output(checkpoint, family):
    path = checkpoint(family)
    prompts = token_prompts(300, [10, 11, 12, 9], seed=2)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = alone(make_llm(path), prompts, params)
    # 14 blocks of 4 tokens: all four prompts start, but cannot all grow to 26+ tokens.
    llm = make_llm(path, num_kv_blocks=14, block_size=4)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, stats
    assert_idle(stats)


@pytest.mark.parametrize("family", ["mamba2", "mamba"])
def test_fewer_state_slots_than_requests(checkpoint, references, family):
    prompts, expected = references(family)
    llm = make_llm(checkpoint(family), max_num_seqs=2)
    assert llm.stats()["state_slots_total"] == 2
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_idle(llm.stats())


def test_memory_planner_lowers_max_num_seqs_instead_of_failing(checkpoint, caplog):
    path = checkpoint("mamba2")
    cfg = make_llm(path).llm_engine.model_config.hf_config
    # float32 conv state [conv_dim, d_conv - 1] + SSM state [heads, head_dim, d_state] per layer
    conv_dim = cfg.num_heads * cfg.head_dim + 2 * cfg.n_groups * cfg.state_size
    per_layer = conv_dim * (cfg.conv_kernel - 1) + cfg.num_heads * cfg.head_dim * cfg.state_size
    per_slot = 4 * per_layer * cfg.num_hidden_layers
    llm = make_llm(path, max_num_seqs=64, cache_memory=per_slot * 5 + 10)
    stats = llm.stats()
    assert stats["state_slots_total"] == 5
    assert "lowering max_num_seqs" in caplog.text
    out = llm.generate(token_prompts(300, [4] * 7), GREEDY)
    assert len(out) == 7


@pytest.mark.parametrize("family", ["bamba", "mamba2", "llama"])
def test_abort_mid_prefill_and_mid_decode(checkpoint, references, family):
    prompts, expected = references(family)
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint(family), device="cpu", dtype="float32", max_num_batched_tokens=8
        )
    )
    engine.add_request("keep", prompts[3], GREEDY)
    engine.add_request("prefill", prompts[4], GREEDY)  # 40 tokens: several steps of prefill
    engine.add_request("decode", prompts[1], GREEDY)
    engine.step()
    engine.abort_request("prefill")
    decoding = False
    while not decoding:
        for out in engine.step():
            decoding |= out.request_id == "decode" and len(out.outputs[0].token_ids) >= 2
    engine.abort_request("decode")
    engine.abort_request("unknown-id")  # aborting what does not exist is a no-op
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            result = out
    assert result.finished and result.outputs[0].token_ids == expected[3]
    assert_idle(engine.stats())


def test_prompt_longer_than_max_model_len_is_rejected_at_once(checkpoint):
    engine = LLMEngine(EngineConfig(model=checkpoint("bamba"), device="cpu", max_model_len=32))
    with pytest.raises(InvalidRequestError, match="prompt has 40 tokens but max_model_len is 32"):
        engine.add_request("long", {"prompt_token_ids": [5] * 40}, GREEDY)
    assert not engine.has_unfinished_requests()
    assert_idle(engine.stats())


def test_prompt_larger_than_the_whole_kv_cache_is_rejected(checkpoint):
    engine = LLMEngine(
        EngineConfig(model=checkpoint("llama"), device="cpu", num_kv_blocks=4, block_size=8)
    )
    with pytest.raises(InvalidRequestError, match="KV cache holds at most 32 tokens"):
        engine.add_request("big", {"prompt_token_ids": [5] * 40}, GREEDY)
    # A request that fits still runs, and generation stops when the cache is full.
    engine.add_request(
        "ok",
        {"prompt_token_ids": [5] * 20},
        SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
    )
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == 12
    assert_idle(engine.stats())


def test_bad_prompts_are_rejected_and_leave_nothing_behind(checkpoint):
    llm = make_llm(checkpoint("bamba"))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([{"prompt_token_ids": []}])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate(["fine", {"prompt_token_ids": [1, 10**6]}])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [3, -1, 4]}])
    for ids in ([1, True], [1, 2.0], [1, "2"], [None], "12"):
        with pytest.raises(InvalidRequestError, match="list of integers"):
            llm.generate([{"prompt_token_ids": ids}])
    assert_idle(llm.stats())
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("family", ["bamba", "mamba", "llama"])
def test_overlapped_steps_equal_one_step_at_a_time(checkpoint, family):
    """Planning step n+1 while step n runs (and building outputs while n+1 runs) changes
    nothing a request sees: tokens, text, logprobs, finish reasons, stop strings, seeded
    n > 1 sampling, under chunked prefill and (attention models) preemption."""
    path = checkpoint(family)
    tok = make_llm(path).get_tokenizer()
    prompts = ["def hello(name):\n    return", "import os", "x", "class Stack:\n    def push"]
    params = [
        SamplingParams(max_tokens=14, temperature=0, logprobs=2, prompt_logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.9, seed=3, n=2, logprobs=0),
        SamplingParams(max_tokens=10, temperature=0, stop=[tok.decode([40, 41])[-1:] or "e"]),
        SamplingParams(max_tokens=9, temperature=0.7, seed=11, presence_penalty=0.5),
    ]
    kv = dict(num_kv_blocks=10, block_size=4) if family != "mamba" else {}
    runs = []
    for overlap in (False, True):
        llm = make_llm(path, overlap_steps=overlap, max_num_batched_tokens=5, **kv)
        runs.append(llm.generate(prompts, params))
        assert_idle(llm.stats())
    for sync, over in zip(*runs, strict=True):
        for a, b in zip(sync.outputs, over.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            )
            # Batches are composed differently, so float32 sums may round differently.
            for pa, pb in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert pa.keys() == pb.keys()
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa)
        if sync.prompt_logprobs is not None:
            for pa, pb in zip(sync.prompt_logprobs[1:], over.prompt_logprobs[1:], strict=True):
                assert pa.keys() == pb.keys()


@pytest.mark.parametrize("family", ["bamba", "llama"])
def test_steps_launched_ahead_take_their_tokens_from_the_device(checkpoint, family, monkeypatch):
    """Step n+1 is launched before step n's tokens are read on the host: its decode
    inputs come from n's sampled ids on the device. Requests that end with a stop token
    while a step for them is already launched (the step's work is thrown away), a
    follow-up turn resumed from the state that step left (prefix caching), and
    penalties (which wait for n's tokens) give what one step at a time gives."""
    from ssmserve.engine.model_runner import ModelRunner

    path = checkpoint(family)
    prompts = token_prompts(make_llm(path).get_tokenizer().vocab_size, [3, 9, 14], seed=5)
    free = make_llm(path).generate(prompts, GREEDY)
    # A stop token each request meets part-way (its 4th greedy token).
    stops = [o.outputs[0].token_ids[3] for o in free]
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[t]) for t in stops]
    params[2] = SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3)
    filled = []
    execute = ModelRunner.execute

    def spy(self, packed, received=None, tokens=None):
        filled.append(tokens is not None)
        return execute(self, packed, received, tokens)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    runs = []
    for overlap in (False, True):
        llm = make_llm(path, overlap_steps=overlap, max_num_batched_tokens=6)
        first = llm.generate(prompts, params)
        # Follow-up turns: each earlier prompt + its output + new tokens.
        turns = [
            {"prompt_token_ids": p["prompt_token_ids"] + list(o.outputs[0].token_ids) + [7, 8]}
            for p, o in zip(prompts, first, strict=True)
        ]
        second = llm.generate(turns, GREEDY)
        runs.append((first, second, [o.num_cached_tokens for o in second]))
        assert_idle(llm.stats())
        assert any(filled) == overlap, "the overlapped run never launched a step ahead"
        filled.clear()
    (first_a, second_a, _), (first_b, second_b, cached) = runs
    for a, b in zip(first_a + second_a, first_b + second_b, strict=True):
        assert (a.outputs[0].token_ids, a.outputs[0].finish_reason) == (
            b.outputs[0].token_ids,
            b.outputs[0].finish_reason,
        )
    for o, stop in zip(first_b[:2], stops[:2], strict=True):
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop
    for p, o, hit in zip(prompts, first_b, cached, strict=True):
        assert hit >= len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) - 1


def test_a_stop_string_completed_by_the_last_allowed_token_still_stops(checkpoint):
    llm = make_llm(checkpoint("llama"))
    free = llm.generate(["import os"], SamplingParams(max_tokens=6, temperature=0))[0]
    text, last = free.outputs[0].text, free.outputs[0].token_ids[-1]
    tail = llm.get_tokenizer().decode([last])
    assert tail and text.endswith(tail)
    # The shortest end of the last token's text that occurs nowhere earlier: the stop
    # string is complete only once the sixth and last allowed token is out.
    stop = next(tail[-j:] for j in range(1, len(tail) + 1) if text.find(tail[-j:]) == len(text) - j)
    out = llm.generate(["import os"], SamplingParams(max_tokens=6, temperature=0, stop=[stop]))
    got = out[0].outputs[0]
    assert got.token_ids == free.outputs[0].token_ids
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.text == text[: len(text) - len(stop)]


def test_startup_objects_are_frozen_once_and_engines_are_still_collected(checkpoint):
    """The objects alive before a process's first engine are kept out of the cyclic
    collector (its full collections stall the step loop); engines and LLMs themselves
    never are: dropped, in reference cycles, while others are alive, they are collected."""
    import gc
    import weakref

    config = EngineConfig(model=checkpoint("mamba2"), device="cpu", dtype="float32")
    first = LLMEngine(config)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    first.cycle = first  # garbage only the cyclic collector can free
    second = LLMEngine(config)  # alive around `first`: freezing it now would leak it
    llm = make_llm(checkpoint("mamba2"))
    llm.cycle = llm
    dropped = [weakref.ref(first), weakref.ref(llm), weakref.ref(llm.llm_engine)]
    del first, llm
    gc.collect()
    assert all(ref() is None for ref in dropped), "a dropped engine or LLM was not collected"
    # Nothing was frozen again (an engine's build adds thousands of objects); a frozen
    # object may still die by reference counting meanwhile, which lowers the count.
    assert gc.get_freeze_count() <= frozen
    second.shutdown()


def test_a_frozen_engine_dies_by_reference_counting_and_shutdown_thaws(checkpoint):
    """`freeze_engine_objects` (the server, the benchmarks) keeps a built engine out of the
    cyclic collector, which could then never free it: so nothing of an engine may sit in a
    reference cycle. Dropped with the collector off, the engine, its runner, model and
    caches are freed at once; `shutdown()` gives everything frozen back to the collector."""
    import gc
    import weakref

    from ssmserve.engine.collector import freeze_engine_objects

    config = EngineConfig(model=checkpoint("bamba"), device="cpu", dtype="float32")
    engine = LLMEngine(config)
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    before = gc.get_freeze_count()
    freeze_engine_objects()
    assert gc.get_freeze_count() > before
    runner = engine.executor.runner
    parts = [engine, engine.executor, runner, runner.model, engine.scheduler]
    parts += [t for t in (engine.state_pool, engine.block_pool) if t is not None]
    parts += list(runner.model.parameters())[:2]
    parts += [t for c in runner.caches for p in (c.kv, c.state) if p for t in p if t is not None]
    parts += [stack for _, stack in runner.cache_stacks]
    refs = [weakref.ref(p) for p in parts]
    del parts, runner
    gc.disable()
    try:
        del engine
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"kept alive by a reference cycle: {[type(a).__name__ for a in alive]}"
    finally:
        gc.enable()
    other = LLMEngine(config)
    freeze_engine_objects()
    other.shutdown()
    assert gc.get_freeze_count() == 0
