"""Validation figures of the bundled tiny models on the held-out stdlib modules.

For each model folder it reports the mean loss (nats per token), perplexity and
bits per byte, computed twice: by Hugging Face transformers (float32) and by
ssmserve through its offline API (``prompt_logprobs``). The two must agree to 1e-3.

Each held-out document is tokenized as ``<|endoftext|>`` + its text and scored in
non-overlapping windows of ``--window`` tokens (each window sees only its own
tokens as context); every token of every document is scored exactly once, so
bits per byte = total NLL / ln 2 / total UTF-8 bytes of the documents.

Usage:
    python scripts/eval_tiny.py                       # the three bundled models
    python scripts/eval_tiny.py path/to/model ...     # any folders
    python scripts/eval_tiny.py --docs .train_data/heldout.json --skip-ssmserve
"""

from __future__ import annotations

import argparse
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
AGREEMENT_TOLERANCE = 1e-3


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


def score_ssmserve(model_path: Path, windows: list[list[int]], num_bytes: int) -> Figures:
    """The same figures through ssmserve's offline API (prompt logprobs)."""
    from ssmserve import LLM, SamplingParams

    start_time = time.perf_counter()
    llm = LLM(model=str(model_path), dtype="float32", device="cpu")
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


def ssmserve_available() -> str | None:
    """None when ``from ssmserve import LLM, SamplingParams`` works, else why not."""
    try:
        from ssmserve import LLM, SamplingParams  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


def evaluate_folder(
    model_path: Path,
    documents: dict[str, str],
    window: int,
    with_ssmserve: bool,
    device: str = "cpu",
) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    windows, num_bytes = make_windows(tokenizer, documents, window)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    result = {"model": model_path.name, "window": window}
    result["transformers"] = asdict(score_transformers(model, windows, num_bytes))
    del model
    if with_ssmserve:
        result["ssmserve"] = asdict(score_ssmserve(model_path, windows, num_bytes))
        result["abs_loss_difference"] = abs(
            result["ssmserve"]["loss"] - result["transformers"]["loss"]
        )
    return result


def format_table(results: list[dict]) -> str:
    lines = [
        "| model | scorer | tokens | bytes | loss (nats/token) | perplexity | bits/byte "
        "| seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        for scorer in ("transformers", "ssmserve"):
            if scorer not in result:
                continue
            f = result[scorer]
            lines.append(
                f"| {result['model']} | {scorer} | {f['num_tokens']} | {f['num_bytes']} | "
                f"{f['loss']:.4f} | {f['perplexity']:.3f} | {f['bits_per_byte']:.4f} | "
                f"{f['seconds']:.1f} |"
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
        default=None,
        help="held-out documents JSON from train_tiny.py (default: read the "
        "held-out modules from this interpreter's stdlib)",
    )
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    parser.add_argument("--skip-ssmserve", action="store_true")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)

    models = args.models or [REPO_ROOT / "ssmserve" / "model_data" / n for n in BUNDLED_MODELS]
    documents = load_heldout_documents(args.docs)
    logger.info(
        "held-out: %d documents, %d bytes",
        len(documents),
        sum(len(t.encode()) for t in documents.values()),
    )

    with_ssmserve = not args.skip_ssmserve
    if with_ssmserve:
        reason = ssmserve_available()
        if reason is not None:
            print(
                f"ssmserve's LLM API is not available ({reason}); "
                "reporting the transformers figures only"
            )
            with_ssmserve = False

    results = []
    for model_path in models:
        logger.info("evaluating %s", model_path)
        results.append(evaluate_folder(model_path, documents, args.window, with_ssmserve))
    print(format_table(results))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")

    failed = [
        r["model"] for r in results if r.get("abs_loss_difference", 0.0) > AGREEMENT_TOLERANCE
    ]
    if failed:
        print(
            f"ssmserve and transformers disagree by more than {AGREEMENT_TOLERANCE} "
            f"nats/token on: {', '.join(failed)}"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
