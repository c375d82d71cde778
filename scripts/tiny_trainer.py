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
# Per-family (sequence length, batch size). transformers' Mamba1 path without
# mamba_ssm scans token by token, so its step time grows with the sequence length and
# hardly with the batch: it trains on shorter sequences. The Bamba takes 128K tokens a
# step: at width 256 a step of 64K left the GPU mostly idle (420K tokens/s on an H200).
# More would not fit an H100 eager: one eager step took about 2.1 GB a window of 1024
# (peak RSS, bf16 autocast on CPU), so 128 windows take about 67 GB.
BATCH_SHAPE = {"bamba": (1024, 128), "mamba2": (1024, 64), "mamba": (512, 128)}
# PEAK_LR was set at 64K tokens a step; a larger step scales it by the square root of
# the ratio (the usual rule for Adam), but never above MAX_SCALED_LR: there was no
# device time for a sweep (the Bamba's 128K tokens a step give 2.8e-3).
REFERENCE_STEP_TOKENS = 65536
MAX_SCALED_LR = 3e-3
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
    # Greedy chat replies are scored at each of these penalties; the first is "chat".
    chat_repetition_penalties: tuple[float, ...] = (1.0,)
    readme_samples: bool = False
    # A checkpoint of the same model to start from instead of a fresh initialisation.
    init_from: Path | None = None
    threads: int | None = None
    # "auto": on CUDA, time eager steps, then torch.compile'd ones, and keep the faster
    # (eager on CPU); "on": compiled from the first step, a failure fails the run; "off".
    compile: str = "auto"
    probe_steps: int = 12


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


# Configuration keys a saved checkpoint adds to build_model's.
SAVED_ONLY = ("architectures", "dtype", "transformers_version")


def load_model(path: Path, family: str, vocab_size: int, eos_id: int):
    """A saved checkpoint of the family, in float32, to train further (``--init-from``):
    its configuration must be the one build_model makes, so the result is the same model
    shape as a fresh run's."""
    from transformers import AutoModelForCausalLM

    expected = build_model(family, vocab_size, eos_id).config.to_diff_dict()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    found = model.config.to_diff_dict()
    keys = sorted(expected.keys() | found.keys())
    differ = [k for k in keys if k not in SAVED_ONLY and expected.get(k) != found.get(k)]
    if differ:
        raise ValueError(
            f"{path} is not a {family} of build_model's shape: {differ[:5]} differ; "
            "--init-from takes a checkpoint of this script's model"
        )
    return model


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


def scaled_peak_lr(family: str, tokens_per_step: int) -> float:
    """PEAK_LR scaled by sqrt(tokens a step / REFERENCE_STEP_TOKENS), within MAX_SCALED_LR."""
    scale = math.sqrt(tokens_per_step / REFERENCE_STEP_TOKENS)
    return min(PEAK_LR[family] * scale, max(MAX_SCALED_LR, PEAK_LR[family]))


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
def chat_stop_fraction(
    model,
    tokenizer,
    records: list[dict],
    max_new_tokens: int = 256,
    repetition_penalty: float = 1.0,
) -> dict:
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
        repetition_penalty=repetition_penalty,
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
        "repetition_penalty": repetition_penalty,
        "stop_fraction": sum(stopped) / max(1, len(records)),
        "samples": samples,
    }


@torch.no_grad()
def readme_samples(model, tokenizer, repetition_penalty: float, max_new_tokens: int) -> dict:
    """Greedy output for the README's two prompts (install_tiny's), with the given penalty.

    What install_tiny.py later records through ssmserve (`ssmserve generate` writes 64
    tokens); here through transformers, so a run can be judged before it is installed.
    """
    import install_tiny

    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": install_tiny.README_CHAT_PROMPT}]
    prompts = {
        "generate": (install_tiny.README_GENERATE_PROMPT, 64),
        "chat": (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            max_new_tokens,
        ),
    }
    out = {"repetition_penalty": repetition_penalty}
    for name, (text, limit) in prompts.items():
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        generated = model.generate(
            ids.to(device),
            max_new_tokens=limit,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, ids.shape[1] :].tolist()
        out[name] = {
            "prompt": text,
            "text": tokenizer.decode(generated, skip_special_tokens=True),
            "tokens": len(generated),
            "stopped": eos in generated,
        }
    return out


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
    by_penalty = {}
    for penalty in options.chat_repetition_penalties:
        chat = chat_stop_fraction(
            model,
            tokenizer,
            records[: options.chat_eval_prompts],
            options.chat_max_new_tokens,
            repetition_penalty=penalty,
        )
        logger.info(
            "chat (repetition penalty %g): %.1f%% of %d held-out prompts stop with EOS "
            "within %d tokens",
            penalty,
            100 * chat["stop_fraction"],
            chat["num_prompts"],
            chat["max_new_tokens"],
        )
        for sample in chat["samples"]:
            logger.info("chat sample: %r -> %r", sample["prompt"], sample["reply"])
        by_penalty[str(penalty)] = chat
    results["chat"] = by_penalty[str(options.chat_repetition_penalties[0])]
    if len(by_penalty) > 1:
        results["chat_by_repetition_penalty"] = by_penalty
    if options.readme_samples:
        import install_tiny

        penalty = install_tiny.GENERATION_DEFAULTS["repetition_penalty"]
        results["readme_samples"] = readme_samples(
            model, tokenizer, penalty, options.chat_max_new_tokens
        )
        for name in ("generate", "chat"):
            sample = results["readme_samples"][name]
            logger.info("README %s (penalty %g): %r", name, penalty, sample["text"])
    return results


# ------------------------------------------------------------------------ train


def loss_function(model, device_type: str):
    """rows [batch, seq + 1] -> mean next-token NLL, bf16 autocast on CUDA."""

    def causal_lm_loss(rows: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits
            return torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)
            )

    return causal_lm_loss


class StepRunner:
    """One optimizer step on a batch, through the eager model or a torch.compile'd loss.

    ``mode`` "off" runs eager. "on" runs compiled from the first step, and a compile
    error fails the run. "auto" (eager on CPU) runs the first ``probe_steps`` steps
    eager and the next ``probe_steps`` compiled, times each set (synchronised, after
    ``PROBE_WARMUP`` untimed steps; the compile itself is timed apart), and keeps the
    faster one for the rest of the run; a compile error there falls back to eager. The
    probe steps are training steps like any other. ``record`` (the report's "compile")
    holds what was measured and chosen; ``current`` names the function in use.
    """

    PROBE_WARMUP = 2

    def __init__(self, model, optimizer, device: torch.device, mode: str, probe_steps: int):
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"compile mode {mode!r}: choose auto, on or off")
        if probe_steps <= self.PROBE_WARMUP:
            raise ValueError(f"probe_steps must exceed {self.PROBE_WARMUP}")
        self.record: dict = {"mode": mode}
        if mode == "auto" and device.type != "cuda":
            mode = "off"
            self.record["note"] = "eager: auto compiles on CUDA only"
        self.model, self.optimizer, self.device = model, optimizer, device
        self.mode, self.probe_steps = mode, probe_steps
        self.eager = loss_function(model, device.type)
        self.compiled = torch.compile(self.eager) if mode != "off" else None
        self.current = "compiled" if mode == "on" else "eager"
        self.stage = {"auto": "probe", "on": "probe", "off": "done"}[mode]
        self.stage_steps = 0
        self.stage_start = 0.0
        if self.stage == "done":
            self.record["chosen"] = "eager"

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic()

    def _run(self, fn, rows: torch.Tensor) -> torch.Tensor:
        loss = fn(rows)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.detach()

    def _compile_failed(self, error: Exception, rows: torch.Tensor) -> torch.Tensor:
        if self.mode == "on":
            raise error
        self.record["error"] = f"{type(error).__name__}: {error}"[:2000]
        self.record["chosen"] = "eager"
        logger.error("torch.compile failed; training on eager: %s", self.record["error"])
        self.optimizer.zero_grad(set_to_none=True)
        self.current, self.stage = "eager", "done"
        return self._run(self.eager, rows)

    def step(self, rows: torch.Tensor, tokens: int) -> torch.Tensor:
        fn = self.compiled if self.current == "compiled" else self.eager
        if self.stage == "done":
            return self._run(fn, rows)
        if self.stage_steps == self.PROBE_WARMUP:
            self.stage_start = self._sync()
        if self.current == "compiled" and self.stage_steps < self.PROBE_WARMUP:
            # The first call traces and compiles forward and backward: timed on its own.
            start = self._sync()
            try:
                loss = self._run(fn, rows)
            except Exception as error:  # noqa: BLE001 - recorded, then eager (mode auto)
                return self._compile_failed(error, rows)
            seconds = round(self._sync() - start, 2)
            self.record.setdefault("compiled_warmup_step_seconds", []).append(seconds)
            logger.info("compiled step %d took %.1f s", self.stage_steps + 1, seconds)
        else:
            loss = self._run(fn, rows)
        self.stage_steps += 1
        if self.stage_steps < self.probe_steps:
            return loss
        rate = (self.probe_steps - self.PROBE_WARMUP) * tokens / (self._sync() - self.stage_start)
        self.record[f"{self.current}_tokens_per_second"] = round(rate)
        logger.info("%s steps: %.0f tokens/s", self.current, rate)
        if self.current == "eager" and self.compiled is not None:
            self.current, self.stage_steps = "compiled", 0
            return loss
        if self.mode == "auto" and rate < self.record["eager_tokens_per_second"]:
            self.current = "eager"
        self.record["chosen"] = self.current
        self.stage = "done"
        logger.info("training on with the %s step function", self.current)
        return loss


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
    if options.init_from is not None:
        model = load_model(options.init_from, family, len(tokenizer), tokenizer.eos_token_id)
    else:
        model = build_model(family, len(tokenizer), tokenizer.eos_token_id)
    model = model.to(device)
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

    peak_lr = options.lr or scaled_peak_lr(family, batch_size * seq_len)
    if device.type == "cuda":
        # The scan's float32 contractions (fast_ssd) on TF32 tensor cores.
        torch.set_float32_matmul_precision("high")
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
        "init_from": None if options.init_from is None else str(options.init_from),
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
    steps = StepRunner(model, optimizer, device, options.compile, options.probe_steps)
    report["compile"] = steps.record

    loop_start = time.monotonic()
    deadline = loop_start + 60.0 * options.minutes
    last_log = last_save = loop_start
    last_log_step = 0
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
            loss = steps.step(rows, batch_size * seq_len)
            step += 1
            now = time.monotonic()
            due_log = now - last_log >= options.log_every_seconds or step == 1
            due_save = now - last_save >= 60.0 * options.save_every_minutes
            if not (due_log or due_save):
                continue
            # NOTE: the loop's one host sync; the GPU runs ahead of it in between.
            value = loss.item()
            now = time.monotonic()
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
                "recent_tokens_per_second": round(
                    (step - last_log_step) * batch_size * seq_len / max(1e-9, now - last_log)
                ),
                "step_function": steps.current,
            }
            if due_save:
                for name, windows in progress_windows.items():
                    entry[f"{name}_loss"] = round(subset_loss(model, windows, autocast), 4)
            report["log"].append(entry)
            report["steps"] = step
            report["tokens_seen"] = step * batch_size * seq_len
            report["train_seconds"] = round(elapsed, 1)
            logger.info(
                "[%s] step %d loss %.4f lr %.2e %.0f tok/s (%.0f recent, %s) %.0fs (%.0fs left)%s",
                family,
                step,
                value,
                lr,
                entry["tokens_per_second"],
                entry["recent_tokens_per_second"],
                steps.current,
                elapsed,
                max(0.0, deadline - now),
                "".join(f" {k} {v}" for k, v in entry.items() if k.endswith("_loss")),
            )
            if due_save:
                save_checkpoint(model, tokenizer, out, report, options.weights_only)
                logger.info("[%s] checkpoint at step %d in %s", family, step, out)
                last_save = time.monotonic()
            last_log, last_log_step = time.monotonic(), step
    except Exception:  # noqa: BLE001 - the run's last checkpoint must survive any failure
        report["status"] = "failed: " + traceback.format_exc(limit=3)
        logger.exception("[%s] training failed at step %d; the last checkpoint stays", family, step)
        write_report(out, report)
        return report

    report["steps"] = step
    report["tokens_seen"] = step * batch_size * seq_len
    report["train_seconds"] = round(time.monotonic() - loop_start, 1)
    if device.type == "cuda":
        report["cuda_max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    if report["status"] == "training":
        report["status"] = "done"
        report["final_train_loss"] = loss.item()
        save_checkpoint(model, tokenizer, out, report, options.weights_only)
        logger.info("[%s] saved step %d to %s", family, step, out)
    del model, optimizer, steps
    try:
        report["heldout"] = final_evaluation(out, tokenizer, options, seq_len)
    except Exception:  # noqa: BLE001 - the weights are saved; record why the figures are missing
        report["evaluation_error"] = traceback.format_exc(limit=3)
        logger.exception("[%s] final evaluation failed; the weights are saved", family)
    write_report(out, report)
    return report
