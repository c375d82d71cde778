"""Validation figures of the bundled tiny models on held-out Python.

For each model folder and each held-out set it reports the mean loss (nats per
token), perplexity and bits per byte, computed twice: by Hugging Face
transformers (float32) and by ssmserve through its offline API
(``prompt_logprobs``); the two must agree to 1e-6 relative. With ``--chat`` it
also reports the fraction of held-out chat prompts whose greedy reply through
``LLM.chat`` ends with EOS within ``--chat-max-tokens`` tokens, sampled with the model
folder's own generation_config.json defaults (what ``ssmserve serve`` gives a request
that leaves them unset; the JSON names the repetition penalty), and with
``--repetition-penalty`` also at each penalty given.

Each held-out document is tokenized as ``<|endoftext|>`` + its text and scored in
non-overlapping windows of ``--window`` tokens (each window sees only its own
tokens as context); every token of every document is scored exactly once, so
bits per byte = total NLL / ln 2 / total UTF-8 bytes of the documents.

Usage:
    python scripts/eval_tiny.py                       # the three bundled models, stdlib set
    python scripts/eval_tiny.py path/to/model ...     # any folders
    python scripts/eval_tiny.py --docs .data/tiny/heldout.json \
        --docs .data/tiny/heldout_third_party.json --chat .data/tiny/chat_heldout.json
    python scripts/eval_tiny.py ssmserve/model_data/ssmserve-bamba-tiny --chat-only \
        --chat .data/tiny/chat_heldout.json --repetition-penalty 1.0 1.1 1.2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
# An installed ssmserve wins; otherwise the checkout this script lives in.
sys.path.append(str(REPO_ROOT))
import tiny_corpus  # noqa: E402

logger = logging.getLogger("eval_tiny")

BUNDLED_MODELS = ("ssmserve-bamba-tiny", "ssmserve-mamba2-tiny", "ssmserve-mamba-tiny")
DEFAULT_WINDOW = 512
RELATIVE_TOLERANCE = 1e-6


@dataclass
class Figures:
    loss: float  # mean NLL, nats per token
    perplexity: float
    bits_per_byte: float
    num_tokens: int
    num_bytes: int
    seconds: float


def load_heldout_documents(docs_path: Path | None = None) -> dict[str, str]:
    """Held-out documents: from a JSON written by train_tiny.py, else this interpreter's stdlib."""
    if docs_path is not None:
        return json.loads(Path(docs_path).read_text(encoding="utf-8"))
    _, heldout = tiny_corpus.list_source_files()
    return tiny_corpus.read_documents(heldout)


def make_windows(tokenizer, documents: dict[str, str], window: int) -> tuple[list[list[int]], int]:
    """Token windows covering every document token once, and the documents' total UTF-8 bytes.

    A window holds up to window + 1 tokens: its first token is context only (the
    leading EOS, or the last token of the previous window).
    """
    eos = tokenizer.eos_token_id
    windows: list[list[int]] = []
    num_bytes = 0
    for name in sorted(documents):
        text = documents[name]
        num_bytes += len(text.encode("utf-8"))
        ids = [eos] + tokenizer.encode(text, add_special_tokens=False)
        for start in range(0, len(ids) - 1, window):
            windows.append(ids[start : start + window + 1])
    return windows, num_bytes


def _figures(total_nll: float, num_tokens: int, num_bytes: int, seconds: float) -> Figures:
    loss = total_nll / num_tokens
    return Figures(
        loss=loss,
        perplexity=math.exp(loss),
        bits_per_byte=total_nll / math.log(2) / num_bytes,
        num_tokens=num_tokens,
        num_bytes=num_bytes,
        seconds=seconds,
    )


@torch.no_grad()
def score_transformers(
    model, windows: list[list[int]], num_bytes: int, batch_size: int = 16
) -> Figures:
    """Total NLL of the windows under a transformers causal LM (in its current dtype/device)."""
    device = next(model.parameters()).device
    start_time = time.perf_counter()
    total_nll = 0.0
    num_tokens = 0
    # Windows of equal length batch without padding (padding changes SSM states).
    by_length: dict[int, list[list[int]]] = {}
    for w in windows:
        by_length.setdefault(len(w), []).append(w)
    for length in sorted(by_length, reverse=True):
        group = by_length[length]
        for i in range(0, len(group), batch_size):
            batch = torch.tensor(group[i : i + batch_size], device=device)
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total_nll += nll.item()
            num_tokens += batch[:, 1:].numel()
    return _figures(total_nll, num_tokens, num_bytes, time.perf_counter() - start_time)


def score_ssmserve(llm, windows: list[list[int]], num_bytes: int) -> Figures:
    """The same figures through ssmserve's offline API (prompt logprobs) of an ``LLM``."""
    from ssmserve import SamplingParams

    start_time = time.perf_counter()
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params)
    total_nll = 0.0
    num_tokens = 0
    for window, output in zip(windows, outputs, strict=True):
        prompt_logprobs = output.prompt_logprobs
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(window)
        for token_id, position in zip(window[1:], prompt_logprobs[1:], strict=True):
            total_nll -= position[token_id].logprob
            num_tokens += 1
    return _figures(total_nll, num_tokens, num_bytes, time.perf_counter() - start_time)


def chat_stop_rate(
    llm, records: list[dict], max_tokens: int, repetition_penalty: float | None = None
) -> dict:
    """Greedy ``LLM.chat`` replies to held-out prompts: the fraction that end with EOS.

    Sampling starts from the model's defaults (``LLM.get_default_sampling_params``, its
    generation_config.json), made greedy and capped at max_tokens; a repetition_penalty
    given replaces the model's.
    """
    start_time = time.perf_counter()
    given = {} if repetition_penalty is None else {"repetition_penalty": repetition_penalty}
    params = dataclasses.replace(
        llm.get_default_sampling_params(), temperature=0.0, max_tokens=max_tokens, **given
    )
    conversations = [r["messages"] for r in records]
    outputs = llm.chat(conversations, params)
    completions = [o.outputs[0] for o in outputs]
    stopped = [c.finish_reason == "stop" for c in completions]
    lengths = [len(c.token_ids) for c in completions]
    return {
        "num_prompts": len(records),
        "max_tokens": max_tokens,
        "repetition_penalty": params.repetition_penalty,
        "stop_fraction": sum(stopped) / max(1, len(records)),
        "mean_reply_tokens": sum(lengths) / max(1, len(lengths)),
        "seconds": time.perf_counter() - start_time,
        "samples": [
            {"source": r["source"], "prompt": r["messages"][-1]["content"], "reply": c.text}
            for r, c in list(zip(records, completions))[:4]
        ],
    }


def evaluate_folder(
    model_path: Path,
    doc_sets: dict[str, dict[str, str]],
    window: int,
    with_ssmserve: bool,
    chat_records: list[dict] | None = None,
    chat_max_tokens: int = 256,
    chat_repetition_penalties: tuple[float, ...] = (),
) -> dict:
    """Figures of one model folder on each held-out set (and the chat stop rate, with the
    model's defaults and at each of chat_repetition_penalties)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    windows = {name: make_windows(tokenizer, docs, window) for name, docs in doc_sets.items()}
    result: dict = {"model": model_path.name, "window": window, "sets": {}}
    if windows:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        for name, (set_windows, num_bytes) in windows.items():
            # NOTE: one window at a time is 1.6x faster on a CPU than 8: transformers'
            # reference scan builds (batch, chunks, chunk, chunk, heads, state) temporaries.
            figures = score_transformers(model, set_windows, num_bytes, batch_size=1)
            result["sets"][name] = {"transformers": asdict(figures)}
        del model
    if with_ssmserve:
        from ssmserve import LLM

        llm = LLM(model=str(model_path), dtype="float32", device="cpu")
        for name, (set_windows, num_bytes) in windows.items():
            figures = score_ssmserve(llm, set_windows, num_bytes)
            entry = result["sets"][name]
            entry["ssmserve"] = asdict(figures)
            reference = entry["transformers"]["loss"]
            entry["rel_loss_difference"] = abs(figures.loss - reference) / reference
        if chat_records is not None:
            result["chat"] = chat_stop_rate(llm, chat_records, chat_max_tokens)
            if chat_repetition_penalties:
                result["chat_by_repetition_penalty"] = [
                    chat_stop_rate(llm, chat_records, chat_max_tokens, penalty)
                    for penalty in chat_repetition_penalties
                ]
    return result


def format_table(results: list[dict]) -> str:
    """Markdown: one row per model, held-out set and scorer."""
    lines = [
        "| model | held-out set | scorer | tokens | bytes | loss (nats/token) | perplexity "
        "| bits/byte |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        for set_name, entry in result["sets"].items():
            for scorer in ("transformers", "ssmserve"):
                if scorer not in entry:
                    continue
                f = entry[scorer]
                lines.append(
                    f"| {result['model']} | {set_name} | {scorer} | {f['num_tokens']:,} | "
                    f"{f['num_bytes']:,} | {f['loss']:.4f} | {f['perplexity']:.2f} | "
                    f"{f['bits_per_byte']:.4f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("models", nargs="*", type=Path, help="model folders (default: bundled)")
    parser.add_argument(
        "--docs",
        type=Path,
        action="append",
        default=None,
        help="a held-out documents JSON from train_tiny.py prepare, once per set (default: "
        "read the held-out stdlib modules of this interpreter)",
    )
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument(
        "--chat", type=Path, default=None, help="chat_heldout.json: also measure the stop rate"
    )
    parser.add_argument("--chat-prompts", type=int, default=64)
    parser.add_argument("--chat-max-tokens", type=int, default=256)
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        nargs="+",
        default=(),
        help="also measure the chat stop rate at each of these repetition penalties (the "
        "first measurement always uses the model's generation_config.json)",
    )
    parser.add_argument(
        "--chat-only", action="store_true", help="only the chat stop rate (needs --chat)"
    )
    parser.add_argument("--skip-ssmserve", action="store_true", help="transformers figures only")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.chat_only and args.chat is None:
        parser.error("--chat-only needs --chat chat_heldout.json")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)

    models = args.models or [REPO_ROOT / "ssmserve" / "model_data" / n for n in BUNDLED_MODELS]
    if args.chat_only:
        doc_sets = {}
    elif args.docs is None:
        doc_sets = {"heldout": load_heldout_documents()}
    else:
        doc_sets = {path.stem: load_heldout_documents(path) for path in args.docs}
    for name, documents in doc_sets.items():
        logger.info(
            "%s: %d documents, %d bytes",
            name,
            len(documents),
            sum(len(t.encode()) for t in documents.values()),
        )
    chat_records = None
    if args.chat is not None:
        chat_records = json.loads(args.chat.read_text(encoding="utf-8"))[: args.chat_prompts]

    results = []
    for model_path in models:
        logger.info("evaluating %s", model_path)
        results.append(
            evaluate_folder(
                model_path,
                doc_sets,
                args.window,
                with_ssmserve=not args.skip_ssmserve,
                chat_records=chat_records,
                chat_max_tokens=args.chat_max_tokens,
                chat_repetition_penalties=tuple(args.repetition_penalty),
            )
        )
    if not args.chat_only:
        print(format_table(results))
    for result in results:
        chats = [result["chat"]] if "chat" in result else []
        for chat in chats + result.get("chat_by_repetition_penalty", []):
            print(
                f"{result['model']}, repetition penalty {chat['repetition_penalty']}: "
                f"{chat['stop_fraction']:.0%} of {chat['num_prompts']} held-out chat prompts "
                f"end with EOS within {chat['max_tokens']} tokens "
                f"(mean reply {chat['mean_reply_tokens']:.0f} tokens)"
            )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")

    failed = [
        f"{r['model']} ({name}: {entry['rel_loss_difference']:.2e})"
        for r in results
        for name, entry in r["sets"].items()
        if entry.get("rel_loss_difference", 0.0) > RELATIVE_TOLERANCE
    ]
    if failed:
        print(
            f"ssmserve and transformers disagree by more than {RELATIVE_TOLERANCE} relative "
            f"on: {', '.join(failed)}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
