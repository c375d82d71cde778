"""The generated blocks of the docs about the bundled models (used by install_tiny.py).

Each block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in its
file and is rewritten whole from a results file (what install_tiny.py measured)
and the data folder's meta.json:

- README.md ``bundled-model``: the summary, figures and real samples;
- ssmserve/model_data/README.md ``models`` (the three folders) and ``bamba-tiny``
  (training run, validation, chat, samples);
- docs/bundled_model.md ``corpus`` (what the training data holds, with licences).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

# The previous ssmserve-bamba-tiny (the same shape, 7.79 M parameters; 6.0 minutes on one
# NVIDIA H100, 377 M tokens of the 47.9 M-token corpus without the synthetic functions),
# measured on the same held-out sets by eval_tiny.py at window 1024, and its chat stop rate
# with the same defaults (repetition penalty 1.1) on the same 64 prompts
# (benchmarks/results/eval_tiny_2026-12-06_retrained.json). The one before it (3.0 minutes
# on one NVIDIA H200) scored 1.0534 and 0.7394 bits per byte and 61%
# (eval_tiny_2026-12-02_defaults_rp1.1.json); the first (6.31 M parameters, stdlib only,
# no chat data) 1.3306, 1.1598 and 0% (eval_tiny_2026-12-01_previous_bamba.json).
PREVIOUS = {
    "description": "the same shape trained for 6.0 minutes on one NVIDIA H100 80GB HBM3 "
    "(377 M tokens of a 47.9 M-token corpus without the short functions)",
    "parameters": 7_785_248,
    "heldout": 0.9578,
    "heldout_third_party": 0.6765,
    "chat_stop_fraction": 0.859375,
}
SET_TITLES = {
    "heldout": "21 held-out stdlib modules",
    "heldout_third_party": "held-out packages anyio, click, httpx",
}


def para(text: str) -> str:
    """A prose paragraph, wrapped as the docs are."""
    return textwrap.fill(text, width=88, break_on_hyphens=False)


def replace_block(path: Path, name: str, content: str) -> None:
    """Replace what lies between the block's markers; fail if the file lacks them."""
    text = path.read_text(encoding="utf-8")
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"{path} must hold exactly one {begin} ... {end} block")
    new = pattern.sub(lambda _: f"{begin}\n{content.strip()}\n{end}", text)
    path.write_text(new, encoding="utf-8")


def _layers(config: dict) -> str:
    attn = config["attn_layer_indices"]
    return (
        f"{config['num_hidden_layers']}: Mamba2 ({config['mamba_n_heads']} heads × "
        f"{config['mamba_d_head']}, d_state {config['mamba_d_state']}, "
        f"{config['mamba_n_groups']} group) and attention at layers "
        f"{', '.join(map(str, attn))} ({config['num_attention_heads']} query / "
        f"{config['num_key_value_heads']} KV heads, RoPE); SwiGLU MLP "
        f"{config['intermediate_size']} in every layer"
    )


def models_table(model_data: Path) -> str:
    """The three bundled folders: class, shape, parameters, weights."""
    from safetensors import safe_open

    rows = [
        "| folder | class | layers | hidden | parameters | embeddings | weights (bf16) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    total = 0
    for name in ("ssmserve-bamba-tiny", "ssmserve-mamba2-tiny", "ssmserve-mamba-tiny"):
        config = json.loads((model_data / name / "config.json").read_text())
        weights = model_data / name / "model.safetensors"
        with safe_open(str(weights), "pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
        size = weights.stat().st_size
        total += size
        if config["model_type"] == "bamba":
            layers = _layers(config)
        elif config["model_type"] == "mamba2":
            layers = (
                f"{config['num_hidden_layers']} Mamba2 ({config['num_heads']} heads × "
                f"{config['head_dim']}, d_state {config['state_size']}, "
                f"{config['n_groups']} group)"
            )
        else:
            layers = (
                f"{config['num_hidden_layers']} Mamba1 (d_inner "
                f"{config['expand'] * config['hidden_size']}, d_state {config['state_size']})"
            )
        tied = "tied" if config.get("tie_word_embeddings") else "untied"
        rows.append(
            f"| {name} | {config['architectures'][0]} | {layers} | {config['hidden_size']} | "
            f"{params / 1e6:.2f} M | {tied} | {size:,} B |"
        )
    rows.append("")
    rows.append(f"Weights together: {total:,} bytes (the budget is 25 MB).")
    return "\n".join(rows)


def _bpb(result: dict, name: str) -> float:
    return result["sets"][name]["transformers"]["bits_per_byte"]


def _lr(value: float) -> str:
    """A learning rate as the docs write it: 2.8e-3."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _compiled(training: dict) -> str:
    """A sentence on the run's step function (the report's "compile", when it has one)."""
    record = training.get("compile")
    if not record or "chosen" not in record:
        return ""
    if record["chosen"] != "compiled":
        return f" The step function ran eager ({record.get('note', record['chosen'])})."
    text = " The step function was torch.compile'd"
    if "eager_tokens_per_second" in record and "compiled_tokens_per_second" in record:
        text += (
            f": `--compile auto` timed {record['compiled_tokens_per_second'] / 1e6:.2f} M "
            f"tokens/s compiled against {record['eager_tokens_per_second'] / 1e6:.2f} M eager "
            "and kept it"
        )
    warmup = record.get("compiled_warmup_step_seconds")
    if warmup:
        text += f" (compiling, {warmup[0]:.0f} s, counts in the budget)"
    return text + "."


def _penalty(chat: dict) -> float:
    # Results files from before eval_tiny named the penalty were measured without one.
    return chat.get("repetition_penalty", 1.0)


def readme_block(results: dict, meta: dict) -> str:
    training = results["training"]
    evaluation = results["evaluation"]
    chat = evaluation["chat"]
    penalty = _penalty(chat)
    generate = evaluation["samples"]["generate"].rstrip()
    reply = evaluation["samples"]["chat"][0]
    worst = max(entry["rel_loss_difference"] for entry in evaluation["sets"].values())
    lines = [
        para(
            f"`ssmserve-bamba-tiny`, the default model, ships inside the package: a "
            f"{training['parameters'] / 1e6:.1f} M-parameter Bamba (Mamba2 layers with "
            f"attention at layers 2, 5 and 8) trained from scratch for "
            f"{training['train_seconds'] / 60:.1f} minutes on one {training['device']} "
            f"({training['tokens_seen'] / 1e6:.0f} M tokens) on Python source: the CPython "
            f"{meta['python'].rsplit('.', 1)[0]} standard library and "
            f"{len(meta['train_packages'])} permissively licensed packages, with 21 stdlib "
            "modules and 3 packages held out, plus chat conversations synthesized from "
            "documented functions, whose assistant turns end with EOS (that is how a reply "
            "learns to stop)"
            + (
                f", and short functions written from {meta['sources']['synthetic']['tasks']} "
                "task descriptions (scripts/tiny_synth.py), `is_prime` among them"
                if "synthetic" in meta["sources"]
                else ""
            )
            + ". It has its own 4096-token byte-level BPE tokenizer and a chat template."
        ),
        "",
        "| held out (never trained on) | this model | previous model |",
        "| --- | --- | --- |",
    ]
    for name, title in SET_TITLES.items():
        lines.append(
            f"| {title}: bits per byte | {_bpb(evaluation, name):.3f} | {PREVIOUS[name]:.3f} |"
        )
    lines += [
        f"| {chat['num_prompts']} chat prompts: greedy reply (repetition penalty {penalty}) "
        f"ends with EOS within {chat['max_tokens']} tokens | {chat['stop_fraction']:.0%} | "
        f"{PREVIOUS['chat_stop_fraction']:.0%} |",
        "",
        para(
            f"The previous model is {PREVIOUS['description']}. "
            f"transformers and ssmserve compute the same figures (to {worst:.0e} relative). "
            "`is_prime` is one of the short functions it was trained on "
            "(`scripts/tiny_synth.py`), so these samples show what it learned, not what it "
            "makes of a request it never saw (for those, see docs/bundled_model.md). "
            "What it writes, greedy, with the sampling defaults of its generation_config.json "
            f"(repetition penalty {penalty}), which `ssmserve serve` and "
            "`LLM.get_default_sampling_params()` use:"
        ),
        "",
        "```text",
        '$ ssmserve generate "def is_prime(n):"',
        generate,
        "```",
        "",
        "```python",
        "from ssmserve import LLM",
        "",
        "llm = LLM()",
        "params = llm.get_default_sampling_params()  # the model's generation_config.json",
        "params.temperature, params.max_tokens = 0, 256",
        f"prompt = {json.dumps(reply['prompt'])}",
        'messages = [{"role": "user", "content": prompt}]',
        "reply = llm.chat(messages, params)",
        "print(reply[0].outputs[0].text)",
        "```",
        "",
        "````text",
        reply["reply"].rstrip(),
        "````",
        "",
        f"(finish reason `{reply['finish_reason']}`, after {reply['tokens']} tokens.)",
    ]
    return "\n".join(lines)


def card_block(results: dict) -> str:
    training = results["training"]
    evaluation = results["evaluation"]
    lines = [
        para(
            f"Trained on one {training['device']} (torch {training['torch']}, bf16 autocast, "
            f"{training['batch_size']} × {training['seq_len']} tokens a step), "
            f"{results['date']}: {training['steps']} steps, "
            f"{training['tokens_seen'] / 1e6:.1f} M tokens in {training['train_seconds']:.0f} s "
            f"(peak LR {_lr(training['peak_lr'])}, cosine over the time budget); last train "
            f"loss {training['final_train_loss']:.3f}.{_compiled(training)} Progress, with the "
            "loss on 32 windows of each held-out set:"
        ),
        "",
        "| step | seconds | train loss | stdlib held-out loss | third-party held-out loss |",
        "| --- | --- | --- | --- | --- |",
    ]
    for entry in training["log"]:
        if "heldout_loss" in entry:
            lines.append(
                f"| {entry['step']} | {entry['seconds']:.0f} | {entry['loss']:.3f} | "
                f"{entry['heldout_loss']:.3f} | {entry['heldout_third_party_loss']:.3f} |"
            )
    lines += [
        "",
        para(
            "Validation (`scripts/eval_tiny.py`, CPU, float32, window 1024; every held-out "
            "token scored once, by transformers and by ssmserve's `prompt_logprobs`):"
        ),
        "",
        "| held-out set | scorer | tokens | bytes | loss (nats/token) | perplexity | bits/byte |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, title in SET_TITLES.items():
        entry = evaluation["sets"][name]
        for scorer in ("transformers", "ssmserve"):
            f = entry[scorer]
            lines.append(
                f"| {title} | {scorer} | {f['num_tokens']:,} | {f['num_bytes']:,} | "
                f"{f['loss']:.4f} | {f['perplexity']:.2f} | {f['bits_per_byte']:.4f} |"
            )
    chat = evaluation["chat"]
    lines += [
        "",
        para(
            f"Chat: of {chat['num_prompts']} held-out write requests (`chat_heldout.json`, "
            f"functions of the held-out modules and packages), {chat['stop_fraction']:.0%} get "
            f"a greedy `LLM.chat` reply that ends with EOS within {chat['max_tokens']} tokens "
            f"(mean reply {chat['mean_reply_tokens']:.0f} tokens), with the model's sampling "
            f"defaults (generation_config.json: repetition penalty {_penalty(chat)})."
        ),
    ]
    sweep = evaluation.get("chat_by_repetition_penalty", [])
    if sweep:
        lines += [
            "",
            "| repetition penalty | replies ending with EOS | mean reply tokens |",
            "| --- | --- | --- |",
        ]
        for run in sweep:
            lines.append(
                f"| {run['repetition_penalty']} | {run['stop_fraction']:.0%} | "
                f"{run['mean_reply_tokens']:.0f} |"
            )
    lines += [
        "",
        para(
            "`ssmserve serve --max-model-len 512`, chat requests without `max_tokens`, with "
            "the defaults (the four held-out prompts the tests check without a penalty):"
        ),
        "",
        "| prompt | finish reason | completion tokens |",
        "| --- | --- | --- |",
    ]
    for served in evaluation["serve"]:
        prompt = served["prompt"].replace("|", "\\|")
        lines.append(f"| {prompt} | {served['finish_reason']} | {served['completion_tokens']} |")
    lines += ["", "Greedy replies:", ""]
    for sample in evaluation["samples"]["chat"]:
        lines += [
            "````text",
            f"<|user|> {sample['prompt']}",
            sample["reply"].rstrip(),
            "````",
            "",
        ]
    return "\n".join(lines)


def _synthetic_row(sources: dict) -> list[str]:
    """The corpus table's row for scripts/tiny_synth.py's functions (newer corpora)."""
    synth = sources.get("synthetic")
    if synth is None:
        return []
    return [
        f"| short functions from {synth['tasks']} task descriptions (`tiny_synth.py`, "
        f"`is_prime` among them) | {synth['files']:,} modules, {synth['conversations']:,} "
        f"conversations | – | {synth['tokens']:,} |"
    ]


def corpus_block(meta: dict) -> str:
    sources = meta["sources"]
    lines = [
        para(
            f"Built by `train_tiny.py prepare` on CPython {meta['python']} "
            f"(`{meta['stdlib']}`, `{meta['site_packages']}`), seed {meta['seed']}:"
        ),
        "",
        "| part | files / conversations | bytes | tokens |",
        "| --- | --- | --- | --- |",
        f"| standard library | {sources['stdlib']['files']:,} | {sources['stdlib']['bytes']:,} "
        f"| {sources['stdlib']['tokens']:,} |",
        f"| third-party packages | {sources['third_party']['files']:,} | "
        f"{sources['third_party']['bytes']:,} | {sources['third_party']['tokens']:,} |",
        f"| chat conversations | {sources['chat']['conversations']:,} | – | "
        f"{sources['chat']['tokens']:,} |",
        *_synthetic_row(sources),
        f"| **stream** | | | **{meta['num_train_tokens']:,}** "
        f"({meta['train_tokens_file_bytes'] / 1e6:.1f} MB as `train_tokens.u16.xz`) |",
        "",
        para(
            f"Held out: {len(meta['heldout_files'])} stdlib files "
            f"({meta['heldout_bytes']:,} bytes) and these packages, whole "
            f"({meta['heldout_third_party_bytes']:,} bytes); "
            f"{meta['heldout_chat_prompts']} chat prompts come from their documented functions:"
        ),
        "",
        "| package | distribution | licence | files | bytes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in meta["heldout_packages"]:
        lines.append(
            f"| {p['name']} | {p['distribution']} {p['version']} | {p['licence']} | "
            f"{p['files']} | {p['bytes']:,} |"
        )
    lines += [
        "",
        "Training packages (each capped; files sampled by a hash of their path):",
        "",
        "| package | distribution | licence | files | bytes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in meta["train_packages"]:
        lines.append(
            f"| {p['name']} | {p['distribution']} {p['version']} | {p['licence']} | "
            f"{p['files']} | {p['bytes']:,} |"
        )
    leaked = meta["left_out_for_leakage"]
    lines += [
        "",
        para(
            f"Left out because they share runs of lines with held-out code ({len(leaked)} "
            "files): " + ", ".join(f"`{path}`" for path in leaked) + "."
        ),
    ]
    return "\n".join(lines)


def rewrite_all(results: dict | None, meta: dict, repo_root: Path) -> None:
    """Rewrite every generated block (the corpus block alone when ``results`` is None)."""
    replace_block(repo_root / "docs" / "bundled_model.md", "corpus", corpus_block(meta))
    if results is None:
        return
    model_data = repo_root / "ssmserve" / "model_data"
    replace_block(repo_root / "README.md", "bundled-model", readme_block(results, meta))
    replace_block(model_data / "README.md", "models", models_table(model_data))
    replace_block(model_data / "README.md", "bamba-tiny", card_block(results))


def summary(results: dict) -> str:
    evaluation = results["evaluation"]
    parts = [f"{name}: {_bpb(evaluation, name):.4f} bits/byte" for name in SET_TITLES]
    parts.append(f"chat stop {evaluation['chat']['stop_fraction']:.0%}")
    parts.append(
        "served chat: "
        + ", ".join(f"{s['finish_reason']} ({s['completion_tokens']})" for s in evaluation["serve"])
    )
    return "; ".join(parts)
