"""Install retrained ssmserve-bamba-tiny weights into the package and refresh every figure.

After a training run (``train_tiny.py train --weights-only``), FOLDER holds
``ssmserve-bamba-tiny/`` with ``model.safetensors``, ``config.json``,
``generation_config.json`` and ``training_report.json`` (or is that folder)::

    python scripts/install_tiny.py --data-dir .data/tiny install FOLDER

It checks the run (finished, same tokenizer as the bundled one, weights within
the size budget), copies the four files into ``ssmserve/model_data/ssmserve-bamba-tiny``
(the tokenizer files there stay), adds the sampling defaults ``GENERATION_DEFAULTS`` to
its generation_config.json, evaluates the installed model on CPU with transformers and
with ssmserve (``eval_tiny.py``: both held-out sets, the chat stop rate with those
defaults and at each of ``CHAT_REPETITION_PENALTIES``), serves it with ``ssmserve
serve`` and sends chat requests without ``max_tokens``, records real samples
(``ssmserve generate "def is_prime(n):"`` and ``LLM.chat`` replies, all with the model's
defaults), writes ``benchmarks/results/eval_tiny_<date>_<label>.json`` (``--label``,
default ``retrained``) and rewrites the generated blocks (``<!-- NAME:begin -->`` ...
``<!-- NAME:end -->``) of README.md, ssmserve/model_data/README.md and
docs/bundled_model.md.

``docs RESULTS`` rewrites the blocks from an existing results file, and
``corpus`` only the corpus block (from the data folder's meta.json), without
installing or evaluating anything.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_tiny  # noqa: E402
import tiny_docs  # noqa: E402

logger = logging.getLogger("install_tiny")

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DATA = REPO_ROOT / "ssmserve" / "model_data"
NAME = "ssmserve-bamba-tiny"
INSTALLED_FILES = ("model.safetensors", "config.json", "generation_config.json")
MAX_BUNDLED_WEIGHT_BYTES = 25_000_000
CHAT_MAX_TOKENS = 256
README_GENERATE_PROMPT = "def is_prime(n):"
README_CHAT_PROMPT = "Write a Python function `is_prime(n)` that returns True if n is a prime."
# Sampling defaults of the installed generation_config.json: what `ssmserve serve` and
# LLM.get_default_sampling_params() use for fields a request leaves unset. The penalty
# comes from the stop rates the model card lists (CHAT_REPETITION_PENALTIES): it raises
# how often a greedy chat reply ends with EOS and cuts repeated lines.
GENERATION_DEFAULTS = {"repetition_penalty": 1.1}
CHAT_REPETITION_PENALTIES = (1.0, 1.1, 1.2)


def find_run_folder(folder: Path) -> Path:
    for candidate in (folder / NAME, folder):
        if (candidate / "model.safetensors").is_file():
            return candidate
    raise FileNotFoundError(f"no {NAME}/model.safetensors under {folder}")


def check_run(run: Path, data_dir: Path) -> dict:
    """The run's report, after checking it is complete and matches the bundled tokenizer."""
    report = json.loads((run / "training_report.json").read_text())
    config = json.loads((run / "config.json").read_text())
    if config.get("architectures") != ["BambaForCausalLM"]:
        raise ValueError(f"{run} holds {config.get('architectures')}, not BambaForCausalLM")
    if report.get("status") != "done":
        raise ValueError(f"the run did not finish cleanly: status {report.get('status')!r}")
    meta = json.loads((data_dir / "meta.json").read_text())
    bundled = (MODEL_DATA / NAME / "tokenizer.json").read_bytes()
    if meta["tokenizer_sha256"] != hashlib.sha256(bundled).hexdigest():
        raise ValueError(
            "the run's data folder was tokenized with another tokenizer than the bundled one; "
            "install that tokenizer too, or rebuild the data with `train_tiny.py prepare`"
        )
    others = sum(
        (MODEL_DATA / n / "model.safetensors").stat().st_size
        for n in eval_tiny.BUNDLED_MODELS
        if n != NAME
    )
    total = others + (run / "model.safetensors").stat().st_size
    if total > MAX_BUNDLED_WEIGHT_BYTES:
        raise ValueError(f"bundled weights would be {total} bytes, over {MAX_BUNDLED_WEIGHT_BYTES}")
    return report


def install(run: Path) -> None:
    target = MODEL_DATA / NAME
    for name in (*INSTALLED_FILES, "training_report.json"):
        shutil.copyfile(run / name, target / name)
    generation_path = target / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    generation.update(GENERATION_DEFAULTS)
    generation_path.write_text(json.dumps(generation, indent=2) + "\n")
    logger.info("installed %s into %s (sampling defaults %s)", run, target, GENERATION_DEFAULTS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_check(model: Path, prompts: list[list[dict]]) -> list[dict]:
    """Chat requests without max_tokens against `ssmserve serve`: how each one ended.

    The server's context is 512 tokens, so that a reply that never stopped would end
    (with finish reason "length") within a minute or two on a CPU.
    """
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "ssmserve.cli", "serve", str(model), "--port", str(port)]
    command += ["--device", "cpu", "--max-model-len", "512", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"ssmserve serve exited:\n{process.stdout.read().decode()}")
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("ssmserve serve did not become healthy in 180 s")
            time.sleep(0.5)
        results = []
        for messages in prompts:
            body = {"model": str(model), "messages": messages, "temperature": 0}
            response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=600)
            response.raise_for_status()
            payload = response.json()
            results.append(
                {
                    "prompt": messages[-1]["content"],
                    "finish_reason": payload["choices"][0]["finish_reason"],
                    "completion_tokens": payload["usage"]["completion_tokens"],
                }
            )
        return results
    finally:
        process.terminate()
        process.wait(timeout=60)


def samples(model: Path, chat_prompt: list[dict]) -> dict:
    """Real output: the README's `ssmserve generate` command, and two greedy chat replies
    with the model's sampling defaults (as the README's example asks for them)."""
    from ssmserve import LLM

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    generate = subprocess.run(
        [sys.executable, "-m", "ssmserve.cli", "generate", README_GENERATE_PROMPT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    llm = LLM(model=str(model), dtype="float32", device="cpu")
    conversations = [[{"role": "user", "content": README_CHAT_PROMPT}], chat_prompt]
    params = llm.get_default_sampling_params()
    params.temperature, params.max_tokens = 0, CHAT_MAX_TOKENS
    chat = []
    for conversation, output in zip(conversations, llm.chat(conversations, params)):
        completion = output.outputs[0]
        chat.append(
            {
                "prompt": conversation[-1]["content"],
                "reply": completion.text,
                "finish_reason": completion.finish_reason,
                "tokens": len(completion.token_ids),
            }
        )
    return {"generate": generate, "chat": chat}


def evaluate(data_dir: Path, max_docs: int | None, chat_prompts: int) -> dict:
    """eval_tiny's figures (both held-out sets, window 1024; chat), the serve check, samples."""
    model = MODEL_DATA / NAME
    doc_sets = {}
    for name in ("heldout", "heldout_third_party"):
        documents = eval_tiny.load_heldout_documents(data_dir / f"{name}.json")
        doc_sets[name] = {k: documents[k] for k in sorted(documents)[:max_docs]}
    records = json.loads((data_dir / "chat_heldout.json").read_text(encoding="utf-8"))
    result = eval_tiny.evaluate_folder(
        model,
        doc_sets,
        1024,
        with_ssmserve=True,
        chat_records=records[:chat_prompts],
        chat_max_tokens=CHAT_MAX_TOKENS,
        chat_repetition_penalties=CHAT_REPETITION_PENALTIES,
    )
    worst = max(entry["rel_loss_difference"] for entry in result["sets"].values())
    if worst > eval_tiny.RELATIVE_TOLERANCE:
        raise AssertionError(f"ssmserve and transformers disagree by {worst:.2e} relative")
    test_prompts = json.loads((MODEL_DATA / "heldout_prompts.json").read_text())["chat"]
    result["serve"] = serve_check(model, [p["messages"] for p in test_prompts])
    result["samples"] = samples(model, test_prompts[0]["messages"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data-dir", type=Path, default=Path(".data/tiny"))
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("install", help="install a run's weights, evaluate, rewrite the docs")
    run.add_argument("folder", type=Path, help="the training run's output folder")
    run.add_argument("--chat-prompts", type=int, default=64)
    run.add_argument("--max-docs", type=int, default=None, help="per held-out set; smoke runs")
    run.add_argument(
        "--label", default="retrained", help="the results file's name: eval_tiny_<date>_<label>"
    )
    docs = sub.add_parser("docs", help="rewrite the generated blocks from a results file")
    docs.add_argument("results", type=Path, help="benchmarks/results/eval_tiny_*.json")
    sub.add_parser("corpus", help="rewrite the corpus block of docs/bundled_model.md only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    meta = json.loads((args.data_dir / "meta.json").read_text())

    if args.command == "corpus":
        tiny_docs.rewrite_all(None, meta, REPO_ROOT)
        return 0
    if args.command == "docs":
        results = json.loads(args.results.read_text())
    else:
        run_folder = find_run_folder(args.folder)
        report = check_run(run_folder, args.data_dir)
        install(run_folder)
        results = {"date": datetime.date.today().isoformat(), "training": report}
        results["evaluation"] = evaluate(args.data_dir, args.max_docs, args.chat_prompts)
        name = f"eval_tiny_{results['date']}_{args.label}.json"
        out = REPO_ROOT / "benchmarks" / "results" / name
        out.write_text(json.dumps(results, indent=2) + "\n")
        logger.info("wrote %s", out)
    tiny_docs.rewrite_all(results, meta, REPO_ROOT)
    print(tiny_docs.summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
