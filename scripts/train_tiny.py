"""Build the data for, and train, the tiny models bundled with ssmserve.

Two stages, so that the data is built once, on the interpreter whose library is
the corpus, and training can run on another machine (with no network):

1. ``prepare``: collect this interpreter's stdlib and the permissively licensed
   site-packages listed in scripts/tiny_corpus.py, hold out the validation
   modules and packages (and drop training files that copy them), synthesize
   chat conversations from the training files' documented functions
   (scripts/tiny_chat.py), add short functions written from task descriptions
   (scripts/tiny_synth.py), tokenize everything with the bundled tokenizer, and
   write one data folder::

       python scripts/train_tiny.py prepare --data-dir .data/tiny

   It holds ``train_tokens.u16.xz`` (the shuffled training stream, documents
   and conversations each preceded by ``<|endoftext|>``), ``heldout.json``
   (stdlib validation set), ``heldout_third_party.json``, ``chat_heldout.json``
   (held-out chat prompts), ``tokenizer/`` and ``meta.json`` (what went in,
   licences, counts).

2. ``train``: train one or more families with transformers' own classes for a
   wall-clock budget, saving a bf16 checkpoint every minute, then evaluate the
   saved weights (scripts/tiny_trainer.py)::

       python scripts/train_tiny.py train --data-dir .data/tiny --out-dir runs/tiny \\
           --models bamba --minutes 4

``snippets`` writes the prompts the tests use (ssmserve/model_data/heldout_prompts.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_tiny  # noqa: E402
import tiny_chat  # noqa: E402
import tiny_corpus  # noqa: E402
import tiny_synth  # noqa: E402
import tiny_trainer  # noqa: E402

logger = logging.getLogger("train_tiny")

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TOKENIZER = REPO_ROOT / "ssmserve" / "model_data" / "ssmserve-bamba-tiny"
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
# Short functions written from task descriptions (scripts/tiny_synth.py): modules of a few
# functions, and chat exchanges per task.
SYNTH_DOCUMENTS = 3000
SYNTH_CHATS_PER_TASK = 100
# Held-out chat prompts whose reference answer fits well inside the 256 tokens
# the stop-rate evaluation allows.
MAX_HELDOUT_REPLY_TOKENS = 200


# --------------------------------------------------------------------- prepare


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer, wrapped as a transformers PreTrainedTokenizerFast.

    This is how the bundled tokenizer was made (on the stdlib training files);
    ``prepare --new-tokenizer`` makes another one.
    """
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


def num_bytes(documents: dict[str, str]) -> int:
    return sum(len(t.encode("utf-8")) for t in documents.values())


def collect_corpus(max_train_files: int | None) -> dict:
    """Training and held-out documents of this interpreter, and where they came from."""
    stdlib_train_files, stdlib_heldout_files = tiny_corpus.list_source_files()
    if max_train_files is not None:
        stdlib_train_files = stdlib_train_files[:max_train_files]
    stdlib_train = tiny_corpus.read_documents(stdlib_train_files)
    heldout = tiny_corpus.read_documents(stdlib_heldout_files)

    packages, third_party, heldout_third_party = [], {}, {}
    train_packages = tiny_corpus.TRAIN_PACKAGES
    if max_train_files is not None:
        train_packages = dict(list(train_packages.items())[:2])
    for name, cap in train_packages.items():
        info = tiny_corpus.check_licence(name)
        docs = tiny_corpus.package_documents(name, cap)
        packages.append(vars(info) | {"files": len(docs), "bytes": num_bytes(docs)})
        third_party.update(docs)
    heldout_packages = []
    for name in tiny_corpus.HELDOUT_PACKAGES:
        info = tiny_corpus.check_licence(name)
        docs = tiny_corpus.package_documents(name, None)
        heldout_packages.append(vars(info) | {"files": len(docs), "bytes": num_bytes(docs)})
        heldout_third_party.update(docs)

    train, dropped = tiny_corpus.leakage_filter(
        {**stdlib_train, **third_party}, [*heldout.values(), *heldout_third_party.values()]
    )
    for path, shared in sorted(dropped.items()):
        why = "duplicate" if shared < 0 else f"{shared} line runs shared with held-out code"
        logger.info("left out %s: %s", path, why)
    return {
        "train": train,
        "heldout": heldout,
        "heldout_third_party": heldout_third_party,
        "packages": packages,
        "heldout_packages": heldout_packages,
        "dropped": dropped,
    }


def encode_conversations(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Token ids of each conversation as the chat template renders it, final EOS dropped.

    The stream puts EOS before every document, so it still follows the last
    assistant turn. Checks that the prompt a client would send (all but the last
    turn, with the generation prompt) tokenizes as a prefix of the conversation,
    so training sees exactly what inference feeds the model.
    """
    eos = tokenizer.eos_token_id
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    prompts = [
        tokenizer.apply_chat_template(c[:-1], tokenize=False, add_generation_prompt=True)
        for c in conversations
    ]
    full = tokenizer(texts, add_special_tokens=False)["input_ids"]
    prefix = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    for ids, head, conversation in zip(full, prefix, conversations):
        if ids[: len(head)] != head or ids[-1] != eos:
            raise AssertionError(f"chat tokenization is not prefix-stable for {conversation!r}")
    return [ids[:-1] for ids in full]


def heldout_chat_records(tokenizer, documents: dict[str, str]) -> list[dict]:
    """Held-out write requests whose reference fits, in a fixed mixed order."""
    records = tiny_chat.heldout_prompts(documents)
    for record in records:
        ids = tokenizer.encode(record["reference"] + "\n", add_special_tokens=False)
        record["reference_tokens"] = len(ids) + 1  # and EOS
    records = [r for r in records if r["reference_tokens"] <= MAX_HELDOUT_REPLY_TOKENS]
    return sorted(records, key=lambda r: hashlib.sha1(r["source"].encode()).hexdigest())


def prepare(data_dir: Path, new_tokenizer: bool, max_train_files: int | None, seed: int) -> None:
    from transformers import PreTrainedTokenizerFast

    data_dir.mkdir(parents=True, exist_ok=True)
    corpus = collect_corpus(max_train_files)
    train = corpus["train"]
    heldout_all = {**corpus["heldout"], **corpus["heldout_third_party"]}
    logger.info(
        "Python %s: train %d files, %d bytes; held out %d stdlib files (%d bytes) and %d "
        "third-party files (%d bytes)",
        sys.version.split()[0],
        len(train),
        num_bytes(train),
        len(corpus["heldout"]),
        num_bytes(corpus["heldout"]),
        len(corpus["heldout_third_party"]),
        num_bytes(corpus["heldout_third_party"]),
    )

    if new_tokenizer:
        tokenizer = train_tokenizer(list(train.values()), VOCAB_SIZE)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(BUNDLED_TOKENIZER)
    tokenizer.save_pretrained(data_dir / "tokenizer")
    heldout_sets = {name: corpus[name] for name in ("heldout", "heldout_third_party")}
    for text in [t for docs in heldout_sets.values() for t in list(docs.values())[:5]]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text, "tokenizer does not round-trip"

    conversations = tiny_chat.training_conversations(train, seed=seed)
    chat_ids = encode_conversations(tokenizer, conversations)
    names = sorted(train)
    file_ids = tokenizer([train[n] for n in names], add_special_tokens=False)["input_ids"]
    is_stdlib = [not n.startswith("site-packages/") for n in names]
    synth_docs = tiny_synth.documents(seed=seed, count=SYNTH_DOCUMENTS)
    synth_chats = tiny_synth.conversations(seed=seed, per_task=SYNTH_CHATS_PER_TASK)
    synth_ids = tokenizer(list(synth_docs.values()), add_special_tokens=False)["input_ids"]
    synth_ids += encode_conversations(tokenizer, synth_chats)
    documents = file_ids + chat_ids + synth_ids
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    eos = tokenizer.eos_token_id
    stream = np.fromiter((t for i in order for t in (eos, *documents[i])), dtype=np.uint16)
    tiny_trainer.write_train_tokens(data_dir / tiny_trainer.TRAIN_TOKENS_FILE, stream)

    records = heldout_chat_records(tokenizer, heldout_all)
    for name, docs in heldout_sets.items():
        (data_dir / f"{name}.json").write_text(json.dumps(docs), encoding="utf-8")
    (data_dir / "chat_heldout.json").write_text(json.dumps(records, indent=1), encoding="utf-8")

    def tokens_where(mask: list[bool]) -> int:
        return sum(len(ids) + 1 for ids, keep in zip(file_ids, mask) if keep)

    tokenizer_json = (data_dir / "tokenizer" / "tokenizer.json").read_bytes()
    meta = {
        "python": sys.version.split()[0],
        "stdlib": str(tiny_corpus.stdlib_dir()),
        "site_packages": str(tiny_corpus.site_packages_dir()),
        "seed": seed,
        "tokenizer": "new" if new_tokenizer else "bundled",
        "tokenizer_sha256": hashlib.sha256(tokenizer_json).hexdigest(),
        "vocab_size": len(tokenizer),
        "heldout_modules": list(tiny_corpus.HELDOUT_MODULES),
        "heldout_files": sorted(corpus["heldout"]),
        "heldout_bytes": num_bytes(corpus["heldout"]),
        "heldout_packages": corpus["heldout_packages"],
        "heldout_third_party_bytes": num_bytes(corpus["heldout_third_party"]),
        "heldout_chat_prompts": len(records),
        "train_packages": corpus["packages"],
        "left_out_for_leakage": {k: v for k, v in sorted(corpus["dropped"].items()) if v >= 0},
        "sources": {
            "stdlib": {
                "files": sum(is_stdlib),
                "bytes": sum(len(train[n].encode()) for n, s in zip(names, is_stdlib) if s),
                "tokens": tokens_where(is_stdlib),
            },
            "third_party": {
                "files": len(names) - sum(is_stdlib),
                "bytes": sum(len(train[n].encode()) for n, s in zip(names, is_stdlib) if not s),
                "tokens": tokens_where([not s for s in is_stdlib]),
            },
            "chat": {
                "conversations": len(conversations),
                "tokens": sum(len(ids) + 1 for ids in chat_ids),
            },
            "synthetic": {
                "files": len(synth_docs),
                "conversations": len(synth_chats),
                "tasks": len(tiny_synth.TASKS),
                "bytes": num_bytes(synth_docs),
                "tokens": sum(len(ids) + 1 for ids in synth_ids),
            },
        },
        "num_train_tokens": int(stream.size),
        "train_tokens_file_bytes": (data_dir / tiny_trainer.TRAIN_TOKENS_FILE).stat().st_size,
    }
    (data_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info(
        "train stream: %d tokens (%s); %d held-out chat prompts",
        stream.size,
        ", ".join(f"{k} {v['tokens']}" for k, v in meta["sources"].items()),
        len(records),
    )


def write_prompt_snippets(
    documents: dict[str, str],
    path: Path,
    chat_records: list[dict] | None,
    count: int = 64,
    num_chars: int = 400,
    chats_per_source: int = 8,
) -> None:
    """Deterministic cuts of the held-out documents, and held-out chat prompts, for the tests.

    Cut i starts at the beginning of a line near fraction i / count of the documents
    concatenated in sorted order. The chat prompts are the first ``chats_per_source``
    stdlib and as many third-party named write requests of ``chat_heldout.json`` whose
    reference answer is at most 100 tokens.
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
        "note": "cuts of the held-out stdlib modules and held-out chat prompts "
        "(scripts/train_tiny.py snippets)",
        "python": sys.version.split()[0],
        "snippets": snippets,
    }
    if chat_records is not None:
        named = [
            r
            for r in chat_records
            if "`" in r["messages"][0]["content"] and r["reference_tokens"] <= 100
        ]
        stdlib = [r for r in named if not r["source"].startswith("site-packages/")]
        third_party = [r for r in named if r["source"].startswith("site-packages/")]
        stdlib, third_party = stdlib[:chats_per_source], third_party[:chats_per_source]
        payload["chat"] = [
            {"source": r["source"], "messages": r["messages"]} for r in stdlib + third_party
        ]
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------- CLI


def format_reports(reports: list[dict]) -> str:
    lines = [
        "| model | params | steps | tokens | train s | stdlib bits/byte | third-party bits/byte "
        "| chat stop |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        h = r.get("heldout", {})
        stdlib = h.get("heldout", {}).get("bits_per_byte", float("nan"))
        third = h.get("heldout_third_party", {}).get("bits_per_byte", float("nan"))
        stop = h.get("chat", {}).get("stop_fraction", float("nan"))
        lines.append(
            f"| {r['name']} | {r['parameters'] / 1e6:.2f}M | {r['steps']} | "
            f"{r['tokens_seen'] / 1e6:.1f}M | {r.get('train_seconds', 0)} | {stdlib:.4f} | "
            f"{third:.4f} | {stop:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="corpus, chat conversations, token stream, held-out sets")
    p.add_argument("--data-dir", type=Path, default=Path(".data/tiny"))
    p.add_argument("--new-tokenizer", action="store_true", help="train a tokenizer, not reuse")
    p.add_argument("--max-train-files", type=int, default=None, help="smoke tests only")
    p.add_argument("--seed", type=int, default=0)

    sn = sub.add_parser("snippets", help="write held-out prompts for the tests")
    sn.add_argument("--docs", type=Path, default=None, help="heldout.json (default: the stdlib)")
    sn.add_argument("--chat", type=Path, default=None, help="chat_heldout.json from prepare")
    sn.add_argument("--out", type=Path, default=Path("ssmserve/model_data/heldout_prompts.json"))

    t = sub.add_parser("train", help="train, save and evaluate models")
    t.add_argument("--data-dir", type=Path, default=Path(".data/tiny"))
    t.add_argument("--out-dir", type=Path, default=Path("runs/tiny"))
    t.add_argument("--models", default="bamba", help="comma-separated: bamba,mamba2,mamba")
    t.add_argument(
        "--minutes",
        type=float,
        default=4.0,
        help="wall-clock budget of each model's training loop (loading comes before it, the "
        "final save and evaluation after)",
    )
    t.add_argument("--max-steps", type=int, default=None, help="exact step count instead")
    t.add_argument("--seq-len", type=int, default=None, help="default: per family")
    t.add_argument("--batch-size", type=int, default=None, help="default: per family")
    t.add_argument("--lr", type=float, default=None, help="peak LR (default: per family)")
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from this checkpoint of the same model (e.g. the bundled one) instead "
        "of a fresh initialisation; warm-up and cosine run as in a fresh run (set --lr)",
    )
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--log-every-seconds", type=float, default=10.0)
    t.add_argument("--save-every-minutes", type=float, default=1.0)
    t.add_argument(
        "--weights-only",
        action="store_true",
        help="checkpoints without tokenizer files (they are the data folder's)",
    )
    t.add_argument("--eval-max-docs", type=int, default=None, help="smoke tests only")
    t.add_argument("--chat-eval-prompts", type=int, default=64)
    t.add_argument(
        "--chat-repetition-penalty",
        type=float,
        nargs="+",
        default=[1.0],
        help="score the greedy chat replies at each of these (the first is the report's chat)",
    )
    t.add_argument(
        "--readme-samples",
        action="store_true",
        help="also record greedy output for the README's prompts (its default penalty)",
    )
    t.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: on CUDA, time eager steps and torch.compile'd ones and keep the faster, "
        "falling back to eager if compiling fails (the report's 'compile' says what happened)",
    )
    t.add_argument("--probe-steps", type=int, default=12, help="steps timed for each (auto)")
    t.add_argument("--threads", type=int, default=None, help="CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.command == "prepare":
        prepare(args.data_dir, args.new_tokenizer, args.max_train_files, args.seed)
        return 0
    if args.command == "snippets":
        chat = json.loads(args.chat.read_text(encoding="utf-8")) if args.chat else None
        write_prompt_snippets(eval_tiny.load_heldout_documents(args.docs), args.out, chat)
        return 0
    reports = []
    for family in args.models.split(","):
        options = tiny_trainer.TrainOptions(
            data_dir=args.data_dir,
            out_dir=args.out_dir,
            family=family,
            minutes=args.minutes,
            max_steps=args.max_steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            device=args.device,
            log_every_seconds=args.log_every_seconds,
            save_every_minutes=args.save_every_minutes,
            weights_only=args.weights_only,
            eval_max_docs=args.eval_max_docs,
            chat_eval_prompts=args.chat_eval_prompts,
            chat_repetition_penalties=tuple(args.chat_repetition_penalty),
            readme_samples=args.readme_samples,
            init_from=args.init_from,
            compile=args.compile,
            probe_steps=args.probe_steps,
            threads=args.threads,
        )
        reports.append(tiny_trainer.train(options))
    print(format_reports(reports))
    return 0 if all(r["status"] == "done" and "heldout" in r for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
