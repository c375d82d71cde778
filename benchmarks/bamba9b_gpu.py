"""How fast and how exact is a Bamba-9B-sized model (random weights) on one GPU?

1. correctness: logprobs of a 200-token prompt and a 16-token greedy continuation, through
   the PyTorch twins and each Triton backend ("triton", and "hopper" on sm_90) in bf16,
   each against a float32 run of the twins on the same weights.
2. speed: the engine as served (kernel_backend "auto", CUDA graphs): a 32k-token prefill,
   128 decode steps after it, decode at batch 1 and batch 64 on 512-token prompts.
3. profile: GPU time per kernel of the prefill step and of batch-1 decode steps.
Floors (DESIGN.md): 4.4 ms per decode step at batch 1 (18.5 GB of weights read once),
0.82 s for a 32k-token prefill (6.4e14 FLOP); benchmarks/results/README.md has both next
to the latest figures.

    PYTHONPATH=$PWD python benchmarks/bamba9b_gpu.py --out results.json    # on the GPU
    PYTHONPATH=$PWD python benchmarks/bamba9b_gpu.py --tiny                # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from ssmserve.config import EngineConfig
from ssmserve.engine.engine import LLMEngine
from ssmserve.kernels import resolve_backend
from ssmserve.sampling_params import SamplingParams

BAMBA_9B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    attn_layer_indices=[9, 18, 27],
    mamba_n_heads=128,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
TINY = dict(
    BAMBA_9B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_indices=[1],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
)


def make_folder(cfg: dict) -> str:
    """config.json (+ a word-level tokenizer covering the vocabulary) for dummy weights."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tempfile.mkdtemp(prefix="bamba9b-")
    transformers.BambaConfig(
        **cfg,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        architectures=["BambaForCausalLM"],
        dtype="bfloat16",
    ).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)
    return path


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drain(engine: LLMEngine) -> list:
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    return finals


def ids(n: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(n)]}


def _prompt_logprobs(engine: LLMEngine, prompt: dict, params: SamplingParams):
    engine.add_request("c", prompt, params)
    out = drain(engine)[0]
    tgt = prompt["prompt_token_ids"]
    lps = [out.prompt_logprobs[i][tgt[i]].logprob for i in range(1, len(tgt))]
    return lps, out.outputs[0].token_ids


def correctness(path: str, vocab: int, device: str, dtype: str) -> dict:
    """Logprobs of a 200-token prompt: the Triton and the PyTorch-twin paths at `dtype`,
    each against a float32 PyTorch-twin run on the same weights (rounded to `dtype`)."""
    prompt = ids(200, vocab, 1)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    common = dict(
        model=path,
        load_format="dummy",
        device=device,
        max_num_batched_tokens=512,
        max_model_len=4096,
        cache_memory=2 * 2**30,
        max_num_seqs=4,
        enforce_eager=True,
    )
    ref_engine = LLMEngine(EngineConfig(dtype="float32", kernel_backend="torch", **common))
    ref_lps, ref_tokens = _prompt_logprobs(ref_engine, prompt, params)
    report = {}
    backends = ["torch", "triton"] + (
        ["hopper"] if resolve_backend("auto", device) == "hopper" else []
    )
    for backend in backends:
        engine = LLMEngine(EngineConfig(dtype=dtype, kernel_backend=backend, **common))
        # Dummy weights are drawn per parameter name in float32 and then cast, so every
        # engine holds the reference's weights rounded to its dtype.
        lps, tokens = _prompt_logprobs(engine, prompt, params)
        diffs = [abs(a - b) for a, b in zip(lps, ref_lps)]
        agree = next((i for i, (x, y) in enumerate(zip(tokens, ref_tokens)) if x != y), len(tokens))
        report[f"{backend}_{dtype}_vs_float32_mean_abs_logprob_diff"] = sum(diffs) / len(diffs)
        report[f"{backend}_{dtype}_vs_float32_max_abs_logprob_diff"] = max(diffs)
        report[f"{backend}_{dtype}_greedy_tokens_agreeing_with_float32"] = agree
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["greedy_tokens"] = len(ref_tokens)
    return report


def served_engine(path: str, device: str, dtype: str, prefill: int, max_num_seqs: int) -> LLMEngine:
    """The engine as served (Triton kernels, CUDA graphs), sized for one `prefill` step."""
    return LLMEngine(
        EngineConfig(
            model=path,
            load_format="dummy",
            device=device,
            dtype=dtype,
            kernel_backend="auto",
            max_num_batched_tokens=prefill,
            max_model_len=prefill + 1024,
            max_num_seqs=max_num_seqs,
        )
    )


def speed(path: str, vocab: int, device: str, dtype: str, prefill: int) -> dict:
    out = {}
    t0 = time.perf_counter()
    engine = served_engine(path, device, dtype, prefill, max_num_seqs=128)
    out["engine_start_s"] = round(time.perf_counter() - t0, 1)
    out["cache"] = engine.stats()
    engine.add_request(
        "warm",
        ids(min(1024, prefill), vocab, 2),
        SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
    )
    drain(engine)

    # One long prefill: the first step computes all `prefill` tokens and samples one.
    engine.add_request(
        "long",
        ids(prefill, vocab, 3),
        SamplingParams(max_tokens=129, ignore_eos=True, temperature=0),
    )
    sync()
    t = time.perf_counter()
    engine.step()
    sync()
    out["prefill_tokens"] = prefill
    out["prefill_s"] = round(time.perf_counter() - t, 4)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        sync()
        steps.append(time.perf_counter() - t)
    steps.sort()
    out["decode_after_long_prefill_ms_median"] = round(1e3 * steps[len(steps) // 2], 2)
    out["decode_steps"] = len(steps)

    for batch in (1, 64):
        for i in range(batch):
            engine.add_request(
                f"b{batch}-{i}",
                ids(512, vocab, 10 + i),
                SamplingParams(max_tokens=65, ignore_eos=True, temperature=0),
            )
        engine.step()  # the prefills
        sync()
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            sync()
            times.append(time.perf_counter() - t)
        times.sort()
        med = times[len(times) // 2]
        out[f"decode_batch{batch}_ms_per_step_median"] = round(1e3 * med, 2)
        out[f"decode_batch{batch}_tokens_per_s"] = round(batch / med, 1)
    out["stats_after"] = engine.stats()
    return out


def _kernel_table(prof, reps: int, top: int = 18) -> dict:
    """GPU time per kernel name (ms per rep), largest first, and the total."""
    totals: dict[str, list[float]] = {}
    kind = (
        torch.autograd.DeviceType.CUDA
        if torch.cuda.is_available()
        else torch.autograd.DeviceType.CPU
    )  # CPU: the --tiny smoke run
    for evt in prof.events():
        if evt.device_type == kind:
            entry = totals.setdefault(evt.name[:90], [0.0, 0])
            entry[0] += evt.time_range.elapsed_us() / 1e3 / reps
            entry[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "total_ms": round(sum(v[0] for v in totals.values()), 3),
        "kernels": [
            {"name": k, "ms": round(v[0], 4), "launches_per_rep": v[1] / reps}
            for k, v in rows[:top]
        ],
    }


def profile(path: str, vocab: int, device: str, dtype: str, prefill: int) -> dict:
    """Per-kernel GPU time of one `prefill`-token prefill step and of batch-1 decode steps
    (CUDA graphs on, as served), from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = served_engine(path, device, dtype, prefill, max_num_seqs=8)
    engine.add_request(
        "warm", ids(1024, vocab, 2), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    )
    drain(engine)
    out = {}
    activities = [ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]
    engine.add_request(
        "long", ids(prefill, vocab, 3), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    )
    sync()
    with torch_profile(activities=activities) as prof:
        engine.step()
        sync()
    out["prefill"] = _kernel_table(prof, 1)
    drain(engine)
    engine.add_request(
        "d", ids(512, vocab, 4), SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
    )
    for _ in range(8):  # the prefill and a few decode steps (graph capture is done)
        engine.step()
    sync()
    reps = 16
    with torch_profile(activities=activities) as prof:
        for _ in range(reps):
            engine.step()
        sync()
    out["decode_batch1"] = _kernel_table(prof, reps)
    drain(engine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small config on CPU (smoke test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill", type=int, default=32768)
    ap.add_argument(
        "--sections",
        default="correctness,speed",
        help="comma-separated subset of correctness,speed,profile",
    )
    ap.add_argument("--commit", default=None, help="commit measured (default: git HEAD)")
    args = ap.parse_args()
    if args.tiny:  # the Triton path runs in the CPU interpreter (the test harness's setup)
        from tests.triton_interpreter import patch_interpreter

        patch_interpreter()
        os.environ["TRITON_INTERPRET"] = "1"
    cfg = TINY if args.tiny else BAMBA_9B
    device = "cpu" if args.tiny else "cuda"
    dtype = "float32" if args.tiny else "bfloat16"
    prefill = 256 if args.tiny else args.prefill
    path = make_folder(cfg)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "config": "tiny" if args.tiny else "Bamba-9B",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    report["commit"] = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    report["command"] = " ".join(["python", *sys.argv])
    sections = [
        ("correctness", lambda: correctness(path, cfg["vocab_size"], device, dtype)),
        ("speed", lambda: speed(path, cfg["vocab_size"], device, dtype, prefill)),
        ("profile", lambda: profile(path, cfg["vocab_size"], device, dtype, prefill)),
    ]
    wanted = set(args.sections.split(","))
    for name, fn in [(n, f) for n, f in sections if n in wanted]:
        try:
            t = time.perf_counter()
            report[name] = fn()
            report[name]["wall_s"] = round(time.perf_counter() - t, 1)
            gc.collect()  # the section's engine, before the next one takes the GPU
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - report and go on to the next section
            report[name] = {"error": traceback.format_exc()}
        print(name, json.dumps(report[name], indent=1), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
