"""Offline throughput: continuous batching against one request at a time."""

from __future__ import annotations

import random
import time

from ssmserve.config import EngineConfig
from ssmserve.engine.engine import LLMEngine
from ssmserve.sampling_params import SamplingParams


def _prompts(vocab: int, num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def run_throughput(
    config: EngineConfig, num_prompts: int, input_len: int, output_len: int
) -> list[dict]:
    """Time `num_prompts` requests of input_len -> output_len tokens (ignore_eos), all at
    once (continuous batching) and one after another. Returns one row per mode."""
    engine = LLMEngine(config)
    prompts = _prompts(engine.model_config.vocab_size, num_prompts, input_len)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    # Warm-up, so one-time costs stay out of both figures.
    engine.add_request("warmup", {"prompt_token_ids": prompts[0]}, params)
    _drain(engine)
    rows = []
    for mode in ("continuous batching", "one at a time"):
        start = time.perf_counter()
        if mode == "continuous batching":
            for i, p in enumerate(prompts):
                engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
            _drain(engine)
        else:
            for i, p in enumerate(prompts):
                engine.add_request(f"s{i}", {"prompt_token_ids": p}, params)
                _drain(engine)
        elapsed = time.perf_counter() - start
        out_tokens = num_prompts * output_len
        rows.append(
            {
                "mode": mode,
                "num_prompts": num_prompts,
                "input_len": input_len,
                "output_len": output_len,
                "seconds": round(elapsed, 3),
                "output_tokens_per_s": round(out_tokens / elapsed, 1),
                "total_tokens_per_s": round(num_prompts * (input_len + output_len) / elapsed, 1),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print(" | ".join(k.ljust(w) for k, w in zip(keys, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))
