"""The training loop of the bundled tiny models (``train_tiny.py train``).

A run is bounded by wall-clock time: ``minutes`` is the training loop's, the
learning rate follows a cosine over that time (or over ``max_steps`` when
given), and a checkpoint is written every
``save_every_minutes`` so that whatever happens at the end, the last minute's
weights are on disk. The final weights are evaluated as saved (bfloat16, read
back from disk): held-out bits per byte on both validation sets and the
fraction of held-out chat prompts whose greedy reply ends with EOS.
"""

from __future__ import annotations

import copy
import json
import logging
import lzma
import math
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import eval_tiny
import fast_ssd
import numpy as np
import torch

logger = logging.getLogger("train_tiny")

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
TRAIN_TOKENS_FILE = "train_tokens.u16.xz"


@dataclass
class TrainOptions:
    """What ``train_tiny.py train`` passes to ``train``; see its --help."""

    data_dir: Path
    out_dir: Path
    family: str
    minutes: float
    max_steps: int | None = None
    seq_len: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    warmup_steps: int = 50
    seed: int = 0
    device: str = "cpu"
    log_every_seconds: float = 10.0
    save_every_minutes: float = 1.0
    weights_only: bool = False
    eval_max_docs: int | None = None
    chat_eval_prompts: int = 64
    chat_max_new_tokens: int = 256
    threads: int | None = None


def build_model(family: str, vocab_size: int, eos_id: int):
    """A freshly initialised transformers model of the given family (see the model card)."""
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
        # 9 layers: Mamba2 everywhere except attention (GQA 4:2, RoPE) at 2, 5 and 8;
        # 7.8 M parameters, 15.6 MB in bf16 (under the 16 MiB a device call returns).
        config = BambaConfig(
            vocab_size=vocab_size,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=9,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[2, 5, 8],
            mamba_n_heads=16,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=64,
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


def lr_at(step: int, progress: float, warmup: int, peak: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% of the peak.

    ``progress`` in [0, 1] is the fraction of the run done (of its time budget,
    or of ``max_steps``).
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max(0.0, progress))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def write_train_tokens(path: Path, tokens: np.ndarray) -> None:
    """The training stream as xz-compressed little-endian uint16 (a quarter of the raw size)."""
    path.write_bytes(lzma.compress(tokens.astype("<u2").tobytes(), preset=6))


def read_train_tokens(path: Path) -> np.ndarray:
    return np.frombuffer(lzma.decompress(path.read_bytes()), dtype="<u2")


# ------------------------------------------------------------------ checkpoints


def save_checkpoint(model, tokenizer, out: Path, report: dict, weights_only: bool) -> None:
    """Write the model as a bf16 Hugging Face folder, one file at a time, atomically.

    Files are written in a scratch folder, then copied next to their final name
    and renamed over it, so a run killed mid-save leaves the previous version of
    each file (and at most one ``*.partial``).
    """
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    staging = Path(tempfile.mkdtemp(prefix="tiny-checkpoint-"))
    try:
        copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(staging)
        GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos).save_pretrained(
            staging
        )
        if not weights_only:
            tokenizer.save_pretrained(staging)
        (staging / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        for file in sorted(staging.iterdir()):
            partial = out / (file.name + ".partial")
            shutil.copyfile(file, partial)
            os.replace(partial, out / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "training_report.json.partial"
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, out / "training_report.json")


# ------------------------------------------------------------------- evaluation


def subset_windows(windows: list[list[int]], length: int, count: int) -> list[list[int]]:
    """Up to ``count`` full-length windows spread evenly over the list."""
    full = [w for w in windows if len(w) == length]
    step = max(1, len(full) // count)
    return full[::step][:count]


def subset_loss(model, windows: list[list[int]], autocast) -> float:
    """Mean NLL (nats per token) of a few windows: the progress figure logged while training."""
    was_training = model.training
    model.eval()
    with autocast:
        figures = eval_tiny.score_transformers(model, windows, num_bytes=1, batch_size=16)
    model.train(was_training)
    return figures.loss


@torch.no_grad()
def chat_stop_fraction(model, tokenizer, records: list[dict], max_new_tokens: int = 256) -> dict:
    """Greedy replies to held-out chat prompts (left-padded batch): how many end with EOS.

    Padding is exact here: transformers zeroes padded positions before the
    Mamba2 mixers and masks them in attention.
    """
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    texts = [
        tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        for r in records
    ]
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = padding_side
    output = model.generate(
        **batch.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    replies = output[:, batch["input_ids"].shape[1] :].tolist()
    stopped = [eos in reply for reply in replies]
    samples = [
        {
            "prompt": r["messages"][-1]["content"],
            "reply": tokenizer.decode(reply, skip_special_tokens=True),
        }
        for r, reply in list(zip(records, replies))[:3]
    ]
    return {
        "num_prompts": len(records),
        "max_new_tokens": max_new_tokens,
        "stop_fraction": sum(stopped) / max(1, len(records)),
        "samples": samples,
    }


def final_evaluation(out: Path, tokenizer, options: TrainOptions, seq_len: int) -> dict:
    """Figures of the checkpoint as saved: bf16 weights read back, scored in float32."""
    from transformers import AutoModelForCausalLM

    device = torch.device(options.device)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    results: dict = {}
    for name in ("heldout.json", "heldout_third_party.json"):
        documents = json.loads((options.data_dir / name).read_text(encoding="utf-8"))
        if options.eval_max_docs is not None:
            documents = {k: documents[k] for k in sorted(documents)[: options.eval_max_docs]}
        windows, num_bytes = eval_tiny.make_windows(tokenizer, documents, seq_len)
        figures = eval_tiny.score_transformers(model, windows, num_bytes, batch_size=16)
        results[name.removesuffix(".json")] = asdict(figures) | {"window": seq_len}
        logger.info(
            "%s: loss %.4f bits/byte %.4f (%d tokens)",
            name,
            figures.loss,
            figures.bits_per_byte,
            figures.num_tokens,
        )
    records = json.loads((options.data_dir / "chat_heldout.json").read_text(encoding="utf-8"))
    chat = chat_stop_fraction(
        model, tokenizer, records[: options.chat_eval_prompts], options.chat_max_new_tokens
    )
    logger.info(
        "chat: %.0f%% of %d held-out prompts stop with EOS within %d tokens",
        100 * chat["stop_fraction"],
        chat["num_prompts"],
        chat["max_new_tokens"],
    )
    for sample in chat["samples"]:
        logger.info("chat sample: %r -> %r", sample["prompt"], sample["reply"])
    results["chat"] = chat
    return results


# ------------------------------------------------------------------------ train


def train(options: TrainOptions) -> dict:
    """Train one model within its time budget, saving as it goes; evaluate; return the report.

    transformers' Mamba2 scan is swapped for scripts/fast_ssd.py's while this runs.
    """
    with fast_ssd.installed():
        return _train(options)


def _train(options: TrainOptions) -> dict:
    from transformers import PreTrainedTokenizerFast

    family = options.family
    device = torch.device(options.device)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(options.data_dir / "tokenizer")
    tokens = read_train_tokens(options.data_dir / TRAIN_TOKENS_FILE)
    stream = torch.from_numpy(tokens.astype(np.int32)).to(device)
    default_seq_len, default_batch = BATCH_SHAPE[family]
    seq_len = options.seq_len or default_seq_len
    batch_size = options.batch_size or default_batch
    model = build_model(family, len(tokenizer), tokenizer.eos_token_id).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "[%s] %.2fM parameters, %d train tokens, batch %d x %d, training for %.1f minutes",
        family,
        num_params / 1e6,
        stream.numel(),
        batch_size,
        seq_len,
        options.minutes,
    )

    peak_lr = options.lr or PEAK_LR[family]
    optimizer = torch.optim.AdamW(
        param_groups(model, 0.1),
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    generator = torch.Generator(device=device).manual_seed(options.seed)
    positions = torch.arange(seq_len + 1, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    progress_windows = {}
    for name in ("heldout.json", "heldout_third_party.json"):
        documents = json.loads((options.data_dir / name).read_text(encoding="utf-8"))
        windows, _ = eval_tiny.make_windows(tokenizer, documents, seq_len)
        progress_windows[name.removesuffix(".json")] = subset_windows(windows, seq_len + 1, 32)

    out = options.out_dir / MODEL_NAMES[family]
    report = {
        "family": family,
        "name": MODEL_NAMES[family],
        "parameters": num_params,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "peak_lr": peak_lr,
        "warmup_steps": options.warmup_steps,
        "minutes": options.minutes,
        "max_steps": options.max_steps,
        "seed": options.seed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "train_tokens": int(stream.numel()),
        "data_meta": json.loads((options.data_dir / "meta.json").read_text()),
        "status": "training",
        "steps": 0,
        "tokens_seen": 0,
        "log": [],
    }
    data_summary = report["data_meta"]
    report["data_meta"] = {k: data_summary[k] for k in ("python", "sources", "num_train_tokens")}

    loop_start = time.monotonic()
    deadline = loop_start + 60.0 * options.minutes
    last_log = last_save = loop_start
    step = 0
    loss = torch.zeros((), device=device)
    model.train()
    try:
        while True:
            now = time.monotonic()
            if options.max_steps is not None:
                if step >= options.max_steps:
                    break
                progress = step / options.max_steps
            else:
                if now >= deadline:
                    break
                progress = (now - loop_start) / max(1e-9, deadline - loop_start)
            offsets = torch.randint(
                0, stream.numel() - seq_len - 1, (batch_size, 1), device=device, generator=generator
            )
            rows = stream[offsets + positions].long()
            lr = lr_at(step, progress, options.warmup_steps, peak_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with autocast:
                logits = model(input_ids=rows[:, :-1], use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            now = time.monotonic()
            due_log = now - last_log >= options.log_every_seconds or step == 1
            due_save = now - last_save >= 60.0 * options.save_every_minutes
            if not (due_log or due_save):
                continue
            value = loss.item()
            if not math.isfinite(value):
                # NOTE: the last checkpoint on disk is the last good one; never overwrite it.
                report["status"] = f"stopped: loss {value} at step {step}"
                logger.error("[%s] %s; keeping the last checkpoint", family, report["status"])
                break
            elapsed = now - loop_start
            entry = {
                "step": step,
                "seconds": round(elapsed, 1),
                "loss": round(value, 4),
                "lr": lr,
                "tokens_per_second": round(step * batch_size * seq_len / elapsed),
            }
            if due_save:
                for name, windows in progress_windows.items():
                    entry[f"{name}_loss"] = round(subset_loss(model, windows, autocast), 4)
            report["log"].append(entry)
            report["steps"] = step
            report["tokens_seen"] = step * batch_size * seq_len
            report["train_seconds"] = round(elapsed, 1)
            logger.info(
                "[%s] step %d loss %.4f lr %.2e %.0f tok/s %.0fs (%.0fs left)%s",
                family,
                step,
                value,
                lr,
                entry["tokens_per_second"],
                elapsed,
                max(0.0, deadline - now),
                "".join(f" {k} {v}" for k, v in entry.items() if k.endswith("_loss")),
            )
            last_log = now
            if due_save:
                save_checkpoint(model, tokenizer, out, report, options.weights_only)
                last_save = time.monotonic()
                logger.info("[%s] checkpoint at step %d in %s", family, step, out)
    except Exception:  # noqa: BLE001 - the run's last checkpoint must survive any failure
        report["status"] = "failed: " + traceback.format_exc(limit=3)
        logger.exception("[%s] training failed at step %d; the last checkpoint stays", family, step)
        write_report(out, report)
        return report

    report["steps"] = step
    report["tokens_seen"] = step * batch_size * seq_len
    report["train_seconds"] = round(time.monotonic() - loop_start, 1)
    if report["status"] == "training":
        report["status"] = "done"
        report["final_train_loss"] = loss.item()
        save_checkpoint(model, tokenizer, out, report, options.weights_only)
        logger.info("[%s] saved step %d to %s", family, step, out)
    del model, optimizer
    try:
        report["heldout"] = final_evaluation(out, tokenizer, options, seq_len)
    except Exception:  # noqa: BLE001 - the weights are saved; record why the figures are missing
        report["evaluation_error"] = traceback.format_exc(limit=3)
        logger.exception("[%s] final evaluation failed; the weights are saved", family)
    write_report(out, report)
    return report
