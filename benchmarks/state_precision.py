"""State precision: what a 16-bit SSM state costs in quality, along a fixed continuation.

1. Reference, float32 state: `--num-seqs` sequences, each a held-out snippet of the
   bundled model's data (`--prompt-len` tokens) continued greedily to `--num-tokens`
   tokens in all. The logprob of every next token is recorded on the way.
2. Variants: bfloat16 and float16 state, each rounded to nearest and stochastically
   (`--mamba-ssm-stochastic-rounding`), teacher-forced through the same token sequences;
   the logprob each gives the reference's next token is recorded.
3. Noise reference: float32 state again, with another batch composition: the sequences
   in reverse order, each beside a filler sequence of random tokens, so every sequence
   sits in another batch row and state slot of a batch twice as large (on a GPU: other
   GEMM shapes and another CUDA graph). What float32 state itself varies by.

Reported per variant against the reference, over every position of every sequence:
mean, p99 and max |Δlogprob| of the forced token, the greedy agreement (argmax equal),
and the mean |Δ| over the last eighth of the positions (drift with length). A variant is
"within noise" when its mean and max |Δ| are at most twice the noise reference's.

Every token goes through a decode step, because that is where a decoding engine writes
the state, once per token: the benchmark drives the engine's executor with its own packed
steps (`StepInputs`, the inputs LLMEngine.step builds), step 0 a one-token prefill per
sequence and every later step one token per sequence, all rows' logits read. Driving the
engine with prompts and `prompt_logprobs` would not do: prompt positions are computed by a
prefill (the chunked scan, which writes the state once per chunk, rounded to nearest), so
it would measure the scan instead of the update. Each variant is a new engine (the state
dtype is an engine setting); dummy weights (`--load-format dummy`) come from the same seed
in each. The bundled model was trained on 4,096-token windows: past that, its attention
extrapolates, and the comparison is between the precisions of the same extrapolation.

    PYTHONPATH=$PWD python benchmarks/state_precision.py \\
        --output benchmarks/results/state_precision_<date>_h200_bamba_tiny.json
    PYTHONPATH=$PWD python benchmarks/state_precision.py --model benchmarks/configs/bamba-9b \\
        --load-format dummy --num-tokens 2048 \\
        --output benchmarks/results/state_precision_<date>_h200_bamba9b.json
    PYTHONPATH=$PWD python benchmarks/state_precision.py --device cpu --num-tokens 256

Engine flags are passed through (--dtype, --device, --enforce-eager, --seed, ...), except
those set per run: the state dtype and rounding, --max-num-seqs, --max-model-len.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from importlib import resources
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from ssmserve.bench.common import fmt, markdown_table, run_metadata, write_json
from ssmserve.config import EngineConfig, add_engine_args
from ssmserve.engine.engine import LLMEngine
from ssmserve.layers.batch import StepInputs

# name -> (mamba_ssm_cache_dtype, stochastic rounding)
VARIANTS = {
    "bfloat16": ("bfloat16", False),
    "bfloat16+sr": ("bfloat16", True),
    "float16": ("float16", False),
    "float16+sr": ("float16", True),
}
NOISE = "float32 (other batch)"
WINDOWS = 8  # the positions are split into this many for the drift figures
NOISE_FACTOR = 2.0


class Trace(NamedTuple):
    """What one run recorded, per sequence and position t (predicting token t + 1)."""

    logprobs: torch.Tensor  # [S, L - 1] float64, of the forced (or chosen) next token
    argmax: torch.Tensor  # [S, L - 1] int64, the model's greedy choice
    seconds: float


def snippet_prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    """`num` prompts of `length` tokens cut from the bundled held-out snippets."""
    data = resources.files("ssmserve").joinpath("model_data", "heldout_prompts.json")
    texts = [s["text"] for s in json.loads(data.read_text())["snippets"]]
    ids = [tokenizer(t).input_ids for t in texts]
    # Snippets long enough, else (very long prompts) all of them end to end.
    ids = [t for t in ids if len(t) >= length] or [sum(ids, [])]
    prompts = []
    for i in range(num):
        source = ids[i % len(ids)]
        window = (i // len(ids)) % (len(source) // length)  # more prompts than snippets
        prompts.append(source[window * length : (window + 1) * length])
    if any(len(p) < length for p in prompts):
        raise ValueError(
            f"the held-out snippets hold fewer than {length} tokens; lower --prompt-len"
        )
    return prompts


def make_engine(args: argparse.Namespace, state_dtype: str, stochastic: bool, rows: int):
    """An engine whose cache holds `rows` sequences of --num-tokens tokens, blocks and
    state slots addressed by the benchmark itself."""
    per_seq = -(-args.num_tokens // args.block_size)
    overrides: dict[str, Any] = dict(
        model=args.model,
        mamba_ssm_cache_dtype=state_dtype,
        mamba_ssm_stochastic_rounding=stochastic,
        max_num_seqs=rows,
        max_model_len=args.num_tokens,
        num_kv_blocks=rows * per_seq,
        enable_prefix_caching=False,
    )
    if args.cache_memory is None and (args.device == "cpu" or not torch.cuda.is_available()):
        overrides["cache_memory"] = 1 << 40  # only what the blocks and slots need is allocated
    engine = LLMEngine(EngineConfig.from_args(args, **overrides))
    plan = engine.cache_plan
    if plan.max_num_seqs < rows:
        engine.shutdown()
        raise RuntimeError(
            f"the cache holds {plan.max_num_seqs} state slots but the run needs {rows}; "
            "lower --num-seqs or --num-tokens, or raise --gpu-memory-utilization"
        )
    return engine


def run_steps(engine, sequences: list[list[int]], length: int) -> Trace:
    """Feed the sequences one token per step; where a sequence is shorter than `length`
    (past its prompt, in the reference run), append the greedy choice."""
    rows = len(sequences)
    device = engine.device
    block_size = engine.config.block_size
    per_seq = -(-length // block_size)
    has_kv = engine.block_pool is not None
    tables = [list(range(r * per_seq, (r + 1) * per_seq)) if has_kv else [] for r in range(rows)]
    generating = any(len(s) < length for s in sequences)
    if not generating:
        targets = torch.tensor([s[1:length] for s in sequences], device=device)
    logprobs = torch.empty(rows, length - 1, dtype=torch.float64, device=device)
    argmax = torch.empty(rows, length - 1, dtype=torch.long, device=device)
    everyone = list(range(rows))
    start = time.perf_counter()
    for t in tqdm(range(length - 1), desc="steps", leave=False, mininterval=2.0):
        inputs = StepInputs(logits_indices=everyone, num_decodes=rows if t else 0)
        for r, seq in enumerate(sequences):
            inputs.add_sequence([seq[t]], t, tables[r], block_size, r)
        logits = engine.executor.execute(inputs.pack()).wait()
        lp = torch.log_softmax(logits.float(), dim=-1)
        best = lp.argmax(dim=-1)
        if generating:
            chosen = best.tolist()
            for r, seq in enumerate(sequences):
                if len(seq) == t + 1:
                    seq.append(chosen[r])
            target = torch.tensor([seq[t + 1] for seq in sequences], device=device)
        else:
            target = targets[:, t]
        logprobs[:, t] = lp.gather(1, target[:, None])[:, 0].double()
        argmax[:, t] = best
    return Trace(logprobs.cpu(), argmax.cpu(), time.perf_counter() - start)


def close(engine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare(trace: Trace, reference: Trace) -> dict[str, Any]:
    delta = (trace.logprobs - reference.logprobs).abs()
    flat = delta.flatten()
    windows = [w.mean().item() for w in delta.chunk(WINDOWS, dim=1)]
    return {
        "mean_abs_dlogprob": flat.mean().item(),
        "p99_abs_dlogprob": flat.quantile(0.99).item() if flat.numel() else 0.0,
        "max_abs_dlogprob": flat.max().item(),
        "greedy_agreement": (trace.argmax == reference.argmax).double().mean().item(),
        "mean_abs_dlogprob_by_window": windows,
        "positions": flat.numel(),
        "seconds": trace.seconds,
    }


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "state",
        "rounding",
        "mean abs Δlogprob",
        "p99 abs",
        "max abs",
        "last 1/8 mean abs",
        "greedy agreement",
        "× noise (mean)",
        "within noise",
    ]
    cells = []
    for r in rows:
        cells.append(
            [
                NOISE if r["variant"] == NOISE else r["state_dtype"],
                r["rounding"],
                f"{r['mean_abs_dlogprob']:.3g}",
                f"{r['p99_abs_dlogprob']:.3g}",
                f"{r['max_abs_dlogprob']:.3g}",
                f"{r['mean_abs_dlogprob_by_window'][-1]:.3g}",
                f"{100 * r['greedy_agreement']:.2f}%",
                "–" if r["over_noise"] is None else fmt(r["over_noise"], 1),
                "–" if r["within_noise"] is None else ("yes" if r["within_noise"] else "no"),
            ]
        )
    return markdown_table(header, cells)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the bundled one)")
    parser.add_argument(
        "--num-tokens", type=int, default=8192, help="tokens per sequence, prompt included"
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (64)")
    parser.add_argument("--num-seqs", type=int, default=8, help="sequences per batch (8)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="16-bit variants to run (default: all four; +sr = stochastic rounding)",
    )
    parser.add_argument("--output", default=None, help="write the JSON report here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.prompt_len < args.num_tokens:
        parser.error("--prompt-len must be at least 1 and below --num-tokens")
    if args.num_seqs < 1:
        parser.error("--num-seqs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    length, S = args.num_tokens, args.num_seqs

    engine = make_engine(args, "float32", False, S)
    meta = run_metadata(os.environ.get("SSMSERVE_COMMIT"), engine.device)
    sequences = snippet_prompts(engine.tokenizer, S, args.prompt_len)
    vocab = engine.model_config.vocab_size
    print(f"reference: float32 state, {S} x {length} tokens", file=sys.stderr, flush=True)
    reference = run_steps(engine, sequences, length)
    close(engine)

    rows = []
    # Noise: reversed, each sequence beside a filler of random tokens (odd rows are ours).
    rng = random.Random(args.seed)
    fillers = [[rng.randrange(vocab) for _ in range(length)] for _ in range(S)]
    mixed = [row for pair in zip(fillers, sequences[::-1]) for row in pair]
    runs = [(NOISE, "float32", False, mixed)]
    runs += [(name, *VARIANTS[name], sequences) for name in args.variants]
    for name, state_dtype, stochastic, batch in runs:
        print(f"{name}: {len(batch)} x {length} tokens", file=sys.stderr, flush=True)
        engine = make_engine(args, state_dtype, stochastic, len(batch))
        trace = run_steps(engine, [list(s) for s in batch], length)
        close(engine)
        if name == NOISE:
            order = list(range(2 * S - 1, 0, -2))  # back to the reference's order
            trace = Trace(trace.logprobs[order], trace.argmax[order], trace.seconds)
        row = {
            "variant": name,
            "state_dtype": state_dtype,
            "rounding": "stochastic" if stochastic else "nearest",
            **compare(trace, reference),
        }
        rows.append(row)
    noise = rows[0]
    for row in rows:
        if row is noise:
            row["over_noise"], row["within_noise"] = None, None
            continue
        base = noise["mean_abs_dlogprob"]
        row["over_noise"] = row["mean_abs_dlogprob"] / base if base > 0 else None
        row["within_noise"] = (
            row["mean_abs_dlogprob"] <= NOISE_FACTOR * noise["mean_abs_dlogprob"]
            and row["max_abs_dlogprob"] <= NOISE_FACTOR * noise["max_abs_dlogprob"]
        )
    report = {
        "meta": meta,
        "model": args.model or "ssmserve-bamba-tiny",
        "load_format": args.load_format,
        "num_tokens": length,
        "prompt_len": args.prompt_len,
        "num_seqs": S,
        "reference": {
            "state_dtype": "float32",
            "mean_logprob": reference.logprobs.mean().item(),
            # How sure the model is along the way: |Δ| shrinks where it is certain.
            "mean_logprob_by_window": [
                w.mean().item() for w in reference.logprobs.chunk(WINDOWS, dim=1)
            ],
            "seconds": reference.seconds,
        },
        "rows": rows,
        "table": table(rows),
    }
    print(report["table"], flush=True)
    if args.output:
        write_json(args.output, report)
    return report


if __name__ == "__main__":
    main()
