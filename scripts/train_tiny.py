"""Train the tiny models bundled with ssmserve on the Python standard library.

Two stages, so that the data is built once, on the interpreter whose stdlib is
the corpus, and training can run on another machine:

1. ``prepare``: walk this interpreter's stdlib (see scripts/tiny_corpus.py for
   what is kept and the fixed held-out module list), train a byte-level BPE
   tokenizer (``tokenizers``; 4096 tokens; ``<|endoftext|>`` is BOS/EOS/PAD,
   plus ``<|system|>``, ``<|user|>``, ``<|assistant|>`` and a chat template),
   tokenize the training documents joined by ``<|endoftext|>`` into a uint16
   array, and write the held-out documents as JSON::

       python scripts/train_tiny.py prepare --data-dir .train_data

2. ``train``: train Bamba (Mamba2 + 2 attention layers), Mamba2 and Mamba with
   transformers' own classes, evaluate each on the held-out modules and save
   each as a complete Hugging Face folder (weights in bfloat16)::

       python scripts/train_tiny.py train --data-dir .train_data --out-dir runs/tiny \\
           --models bamba,mamba2,mamba --parallel --time-budget 300

   With ``--parallel`` each model trains in its own process on the same device.
   The learning-rate schedule is fixed by the step count: ``--max-steps`` gives it
   exactly; without it, the step count is estimated from ``--time-budget`` after
   warm-up and logged, so a run can be repeated with ``--max-steps``.

Seeds are fixed (``--seed``); on CUDA, kernels' nondeterminism aside, a run is
repeatable.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_tiny  # noqa: E402
import fast_ssd  # noqa: E402
import tiny_corpus  # noqa: E402

logger = logging.getLogger("train_tiny")

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)

MODEL_NAMES = {
    "bamba": "ssmserve-bamba-tiny",
    "mamba2": "ssmserve-mamba2-tiny",
    "mamba": "ssmserve-mamba-tiny",
}
# Per-family peak learning rate: the hybrid's attention layers want a lower one.
PEAK_LR = {"bamba": 2e-3, "mamba2": 3e-3, "mamba": 3e-3}
# Per-family (sequence length, batch size), 64K tokens a step each. transformers'
# Mamba1 path without mamba_ssm scans token by token, so its step time grows with
# the sequence length and hardly with the batch: it trains on shorter sequences.
BATCH_SHAPE = {"bamba": (1024, 64), "mamba2": (1024, 64), "mamba": (512, 128)}


# --------------------------------------------------------------------- prepare


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer, wrapped as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # NOTE: add_prefix_space=False and the ByteLevel decoder make decode(encode(x)) == x.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(CHAT_TOKENS),
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def prepare(data_dir: Path, vocab_size: int, max_train_files: int | None) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    root = tiny_corpus.stdlib_dir()
    train_files, heldout_files = tiny_corpus.list_source_files(root)
    if max_train_files is not None:
        train_files = train_files[:max_train_files]
    train_docs = tiny_corpus.read_documents(train_files, root)
    heldout_docs = tiny_corpus.read_documents(heldout_files, root)
    logger.info("stdlib %s (Python %s)", root, sys.version.split()[0])
    logger.info(
        "train: %d files, %d bytes; held-out: %d files, %d bytes",
        len(train_docs),
        sum(len(t.encode()) for t in train_docs.values()),
        len(heldout_docs),
        sum(len(t.encode()) for t in heldout_docs.values()),
    )

    start = time.perf_counter()
    tokenizer = train_tokenizer(list(train_docs.values()), vocab_size)
    tokenizer.save_pretrained(data_dir / "tokenizer")
    logger.info("tokenizer trained in %.1fs", time.perf_counter() - start)

    for text in list(heldout_docs.values())[:5]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, "tokenizer does not round-trip"

    eos = tokenizer.eos_token_id
    encoded = tokenizer(list(train_docs.values()), add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for ids in encoded for t in (eos, *ids)), dtype=np.uint16)
    np.save(data_dir / "train_tokens.npy", stream)
    (data_dir / "heldout.json").write_text(json.dumps(heldout_docs), encoding="utf-8")
    num_train_bytes = sum(len(t.encode()) for t in train_docs.values())
    meta = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "heldout_modules": list(tiny_corpus.HELDOUT_MODULES),
        "heldout_files": sorted(heldout_docs),
        "num_train_files": len(train_docs),
        "num_train_bytes": num_train_bytes,
        "num_train_tokens": int(stream.size),
        "bytes_per_token": num_train_bytes / stream.size,
        "vocab_size": len(tokenizer),
    }
    (data_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("train stream: %d tokens (%.2f bytes/token)", stream.size, meta["bytes_per_token"])


def write_prompt_snippets(
    documents: dict[str, str], path: Path, count: int = 64, num_chars: int = 400
) -> None:
    """Deterministic cuts of the held-out documents, for tests that must not need the corpus.

    Cut i starts at the beginning of a line near fraction i / count of the documents
    concatenated in sorted order.
    """
    names = sorted(documents)
    total = sum(len(documents[n]) for n in names)
    snippets = []
    for i in range(count):
        target = i * total // count
        for name in names:
            text = documents[name]
            if target < len(text):
                start = text.rfind("\n", 0, target) + 1
                snippets.append(
                    {"source": name, "offset": start, "text": text[start : start + num_chars]}
                )
                break
            target -= len(text)
    payload = {
        "note": "cuts of the held-out stdlib modules (scripts/train_tiny.py snippets)",
        "python": sys.version.split()[0],
        "snippets": snippets,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------- models


def build_model(family: str, vocab_size: int, eos_id: int, seq_len: int):
    """A freshly initialised transformers model of the given family (see README sizes)."""
    from transformers import (
        BambaConfig,
        BambaForCausalLM,
        Mamba2Config,
        Mamba2ForCausalLM,
        MambaConfig,
        MambaForCausalLM,
    )

    special = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}
    if family == "bamba":
        # 8 layers: Mamba2 everywhere except attention (GQA 4:2, RoPE) at 2 and 5.
        config = BambaConfig(
            vocab_size=vocab_size,
            hidden_size=256,
            intermediate_size=384,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[2, 5],
            mamba_n_heads=16,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=32,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            **special,
        )
        return BambaForCausalLM(config)
    if family == "mamba2":
        config = Mamba2Config(
            vocab_size=vocab_size,
            hidden_size=128,
            num_hidden_layers=7,
            num_heads=8,
            head_dim=32,
            state_size=32,
            n_groups=1,
            expand=2,
            conv_kernel=4,
            chunk_size=64,
            tie_word_embeddings=False,
            **special,
        )
        return Mamba2ForCausalLM(config)
    if family == "mamba":
        config = MambaConfig(
            vocab_size=vocab_size,
            hidden_size=192,
            num_hidden_layers=4,
            state_size=16,
            expand=2,
            conv_kernel=4,
            tie_word_embeddings=True,
            **special,
        )
        return MambaForCausalLM(config)
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(MODEL_NAMES)}")


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        # Matrices decay; norms, biases, SSM A/D/dt parameters and embeddings do not.
        if param.ndim >= 2 and "embed" not in name and "embeddings" not in name:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_at(step: int, total_steps: int, warmup: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------ train


def train_one(args, family: str) -> dict:
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    device = torch.device(args.device)
    fast_ssd.install()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.data_dir / "tokenizer")
    stream = torch.from_numpy(np.load(args.data_dir / "train_tokens.npy").astype(np.int64))
    seq_len, batch_size = BATCH_SHAPE[family]
    seq_len = args.seq_len or seq_len
    batch_size = args.batch_size or batch_size
    model = build_model(family, len(tokenizer), tokenizer.eos_token_id, seq_len).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("[%s] %.2fM parameters, %d train tokens", family, num_params / 1e6, stream.numel())

    peak_lr = args.lr or PEAK_LR[family]
    optimizer = torch.optim.AdamW(
        param_groups(model, 0.1),
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    generator = torch.Generator().manual_seed(args.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    total_steps = args.max_steps
    warmup = args.warmup_steps if total_steps is None else min(args.warmup_steps, total_steps)
    start = time.perf_counter()
    step = 0
    tokens_seen = 0
    losses: list[float] = []
    model.train()
    while total_steps is None or step < total_steps:
        offsets = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
        rows = torch.stack([stream[o : o + seq_len + 1] for o in offsets.tolist()])
        rows = rows.to(device, non_blocking=True)
        lr = lr_at(step, total_steps or 10**9, warmup, peak_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast:
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += rows[:, 1:].numel()
        if step % args.log_every == 0 or step == 1:
            losses.append(loss.item())
            elapsed = time.perf_counter() - start
            logger.info(
                "[%s] step %d loss %.4f lr %.2e %.0f tok/s %.0fs",
                family,
                step,
                losses[-1],
                lr,
                tokens_seen / elapsed,
                elapsed,
            )
        elapsed = time.perf_counter() - start
        if total_steps is None and (step == args.warmup_steps or elapsed > 0.1 * args.time_budget):
            # Fix the schedule's length from the measured speed (see module docstring).
            per_step = elapsed / step
            total_steps = max(step + 1, int(args.time_budget / per_step))
            logger.info("[%s] %.3fs/step: training %d steps", family, per_step, total_steps)
        if args.max_steps is None and elapsed > 1.1 * args.time_budget:
            # NOTE: a hard stop, so that a slow device can never overrun its lease.
            logger.info("[%s] stopping at step %d: over the time budget", family, step)
            break
    train_seconds = time.perf_counter() - start
    final_loss = loss.item()

    model.eval()
    model.float()
    documents = json.loads((args.data_dir / "heldout.json").read_text(encoding="utf-8"))
    if args.eval_max_docs is not None:
        documents = {k: documents[k] for k in sorted(documents)[: args.eval_max_docs]}
    windows, num_bytes = eval_tiny.make_windows(tokenizer, documents, seq_len)
    figures = eval_tiny.score_transformers(model, windows, num_bytes, batch_size=64)
    logger.info(
        "[%s] held-out loss %.4f ppl %.3f bits/byte %.4f",
        family,
        figures.loss,
        figures.perplexity,
        figures.bits_per_byte,
    )

    out = args.out_dir / MODEL_NAMES[family]
    if out.exists():
        shutil.rmtree(out)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    ).save_pretrained(out)
    report = {
        "family": family,
        "name": MODEL_NAMES[family],
        "parameters": num_params,
        "steps": step,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens_seen": tokens_seen,
        "peak_lr": peak_lr,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": final_loss,
        "train_loss_curve": losses,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "heldout": {
            "window": seq_len,
            "loss": figures.loss,
            "perplexity": figures.perplexity,
            "bits_per_byte": figures.bits_per_byte,
            "num_tokens": figures.num_tokens,
            "num_bytes": figures.num_bytes,
        },
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_parallel(args, families: list[str]) -> list[dict]:
    """One process per model on the same device; they are launch-bound, so they overlap well."""
    processes = []
    for family in families:
        command = [sys.executable, __file__, "train", "--models", family]
        for key in (
            "data_dir",
            "out_dir",
            "time_budget",
            "seed",
            "device",
            "log_every",
            "warmup_steps",
        ):
            command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        for key in ("seq_len", "batch_size", "max_steps", "lr", "eval_max_docs", "threads"):
            if getattr(args, key) is not None:
                command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        log = open(args.out_dir / f"train_{family}.log", "w")  # noqa: SIM115
        processes.append(
            (family, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log)
        )
    failed = []
    for family, process, log in processes:
        if process.wait() != 0:
            failed.append(family)
        log.close()
    if failed:
        raise SystemExit(f"training failed for {failed}; see {args.out_dir}/train_*.log")
    return [
        json.loads((args.out_dir / MODEL_NAMES[f] / "training_report.json").read_text())
        for f in families
    ]


def format_reports(reports: list[dict]) -> str:
    lines = [
        "| model | params | steps | tokens | train s | train loss | val loss | val ppl | "
        "val bits/byte |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        h = r["heldout"]
        lines.append(
            f"| {r['name']} | {r['parameters'] / 1e6:.2f}M | {r['steps']} | "
            f"{r['tokens_seen'] / 1e6:.1f}M | {r['train_seconds']} | "
            f"{r['final_train_loss']:.3f} | {h['loss']:.4f} | {h['perplexity']:.3f} | "
            f"{h['bits_per_byte']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="corpus, tokenizer and token arrays")
    p.add_argument("--data-dir", type=Path, default=Path(".train_data"))
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--max-train-files", type=int, default=None, help="smoke tests only")

    sn = sub.add_parser("snippets", help="write held-out prompt snippets for the tests")
    sn.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="held-out documents JSON (default: this interpreter's stdlib)",
    )
    sn.add_argument("--out", type=Path, default=Path("ssmserve/model_data/heldout_prompts.json"))

    t = sub.add_parser("train", help="train, evaluate and save models")
    t.add_argument("--data-dir", type=Path, default=Path(".train_data"))
    t.add_argument("--out-dir", type=Path, default=Path("runs/tiny"))
    t.add_argument("--models", default="bamba,mamba2,mamba")
    t.add_argument("--seq-len", type=int, default=None, help="default: per family")
    t.add_argument("--batch-size", type=int, default=None, help="default: per family")
    t.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="exact step count (default: estimated from --time-budget)",
    )
    t.add_argument("--time-budget", type=float, default=300.0, help="seconds per model")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--lr", type=float, default=None, help="peak LR (default: per family)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--eval-max-docs", type=int, default=None, help="smoke tests only")
    t.add_argument("--threads", type=int, default=None, help="CPU threads per process")
    t.add_argument("--parallel", action="store_true", help="one process per model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.command == "prepare":
        prepare(args.data_dir, args.vocab_size, args.max_train_files)
        return 0
    if args.command == "snippets":
        write_prompt_snippets(eval_tiny.load_heldout_documents(args.docs), args.out)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    families = args.models.split(",")
    if args.parallel and len(families) > 1:
        reports = run_parallel(args, families)
    else:
        reports = [train_one(args, family) for family in families]
    print(format_reports(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
