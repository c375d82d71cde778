"""Do the Triton kernels give the PyTorch twins' logprobs on a real-size model with random
weights (`--load-format dummy`)?

    PYTHONPATH=$PWD python benchmarks/backend_agreement.py \
        --model benchmarks/configs/granite-4.0-h-tiny --out agreement.json

Each backend (`--backends`, the first one the reference) runs in its own engine, one after
the other (a Jamba-Mini-sized model fits on an H200 only once), on the same seeded random
weights: `--prompts` random token-id prompts of `--prompt-len` tokens with their prompt
logprobs, then a greedy continuation of `--gen-len` tokens. Reported against the
reference: mean and max |delta logprob| over every prompt position, how many greedy
continuations agree token for token, the mean length they agree for, and the mean
|delta logprob| of the chosen tokens over that common part. `--reference-dtype float32`
runs the reference in float32 where it fits (weights drawn the same, then rounded to
the others' dtype).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics

import torch

from ssmserve import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a config folder or checkpoint")
    parser.add_argument("--backends", default="torch,auto", help="comma-separated; first = ref")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reference-dtype", default=None, help="default: --dtype")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    return parser.parse_args()


def run(opts: argparse.Namespace, backend: str, dtype: str, prompts: list[dict]) -> dict:
    llm = LLM(
        opts.model,
        load_format="dummy",
        kernel_backend=backend,
        dtype=dtype,
        device=opts.device,
        seed=opts.seed,
        max_model_len=opts.prompt_len + opts.gen_len,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=max(opts.prompt_len, 256),
        gpu_memory_utilization=opts.gpu_memory_utilization,
    )
    try:
        params = SamplingParams(
            max_tokens=opts.gen_len, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0
        )
        outs = llm.generate(prompts, params)
        resolved = llm.llm_engine.executor.runner.ops.backend
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result = {"backend": backend, "resolved": resolved, "dtype": dtype, "prompt": [], "gen": []}
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt["prompt_token_ids"]
        prompt_lps = out.prompt_logprobs
        result["prompt"].append([prompt_lps[i][ids[i]].logprob for i in range(1, len(ids))])
        got = out.outputs[0]
        result["gen"].append([(t, got.logprobs[i][t].logprob) for i, t in enumerate(got.token_ids)])
    return result


def compare(ref: dict, other: dict) -> dict:
    deltas = [
        abs(a - b)
        for ra, rb in zip(ref["prompt"], other["prompt"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    ]
    agree, common, chosen = 0, [], []
    for ga, gb in zip(ref["gen"], other["gen"], strict=True):
        n = next((i for i, (a, b) in enumerate(zip(ga, gb)) if a[0] != b[0]), len(ga))
        agree += n == len(ga)
        common.append(n)
        chosen += [abs(ga[i][1] - gb[i][1]) for i in range(n)]
    return {
        "backend": other["backend"],
        "resolved": other["resolved"],
        "mean_abs_delta_prompt_logprob": statistics.fmean(deltas),
        "max_abs_delta_prompt_logprob": max(deltas),
        "greedy_identical": f"{agree}/{len(ref['gen'])}",
        "mean_common_prefix": statistics.fmean(common),
        "mean_abs_delta_chosen_logprob": statistics.fmean(chosen) if chosen else None,
    }


def main() -> None:
    opts = parse_args()
    backends = opts.backends.split(",")
    rng = random.Random(opts.seed)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(opts.model).vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(opts.prompt_len)]}
        for _ in range(opts.prompts)
    ]
    ref = run(opts, backends[0], opts.reference_dtype or opts.dtype, prompts)
    rows = [compare(ref, run(opts, b, opts.dtype, prompts)) for b in backends[1:]]
    print(f"reference: {ref['resolved']} in {ref['dtype']}; model {opts.model}")
    print("| backend | mean abs dlogprob (prompt) | max | greedy identical | common prefix |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['resolved']} | {r['mean_abs_delta_prompt_logprob']:.2e} | "
            f"{r['max_abs_delta_prompt_logprob']:.2e} | {r['greedy_identical']} | "
            f"{r['mean_common_prefix']:.1f} / {opts.gen_len} |"
        )
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"args": vars(opts), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
