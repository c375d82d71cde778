"""Prompt tokenization off the event loop, and the size bound that refuses a prompt before
tokenizing it.

Tokenizing a large prompt takes seconds; on the event loop it would stall every client.
`PromptTokenizer` runs it on a fixed pool of daemon threads (a tokenization still running
at shutdown does not hold the process), through the Rust tokenizer's offset-free batch
call, which leaves the interpreter lock to the event loop while it works.

Before that, `max_bytes_per_token` gives, where the tokenizer's pipeline proves one, the
most UTF-8 bytes of input one token can stand for. A text of B bytes then has at least
ceil(B / N) tokens, so a prompt whose byte count alone proves it longer than the context is
refused without being tokenized.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

from ssmserve.server.errors import bad_request

logger = logging.getLogger(__name__)

# Pre-tokenizers that never drop input: every byte ends up in some token.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep input unless behavior "Removed"


class WorkerPool:
    """`size` daemon threads running blocking calls for the event loop, in arrival order."""

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(size)
        ]
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a pool thread; a caller that is cancelled before it starts skips it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, args, future, loop))
        return await future

    def close(self) -> None:
        """Let the threads exit once the queued work is done."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future, loop = job
            if future.cancelled():
                continue
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_resolve, future, result, error)
            except RuntimeError:
                return  # the event loop is closed: nobody waits any more


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most input bytes one token can cover, or None where the pipeline proves no bound.

    A bound holds for a BPE model that cannot meet an unknown character (byte-level, or
    with byte fallback and all 256 byte tokens), behind a normalizer that never shortens
    text (none, or Prepend / Replace with a replacement at least as long) and
    pre-tokenizers that never drop text, with no added token that strips whitespace
    around it. Then every input byte is covered by exactly one token, and a token covers
    at most its own length: its characters under byte-level (one character per byte),
    its UTF-8 bytes otherwise, which is never less than the input it stands for.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _normalizer_keeps_length(spec.get("normalizer")):
        return None
    pre = spec.get("pre_tokenizer")
    if not _pre_tokenizer_keeps_text(pre):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    byte_level = _has_byte_level(pre)
    if byte_level:
        from tokenizers.pre_tokenizers import ByteLevel

        if not set(ByteLevel.alphabet()) <= vocab.keys():
            return None  # a byte outside the vocabulary would be dropped
        longest = max(len(token) for token in vocab)
    elif model.get("byte_fallback"):
        if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
            return None
        longest = max(len(token.encode("utf-8")) for token in vocab)
    else:
        return None  # unknown characters become an unknown token of any length
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None  # it swallows any run of whitespace next to it
        longest = max(longest, len(added["content"].encode("utf-8")))
    return longest


def _normalizer_keeps_length(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(s) for s in spec.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        if "String" not in pattern:
            return False  # a regex can match more than its replacement
        return len(spec.get("content", "").encode()) >= len(pattern["String"].encode())
    return False


def _pre_tokenizer_keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(s) for s in spec.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_has_byte_level(s) for s in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


class PromptTokenizer:
    """Tokenizes prompts for the endpoints: size-checked, on the worker pool."""

    def __init__(self, tokenizer: Any, pool: WorkerPool, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.max_model_len = max_model_len
        self.max_bytes_per_token = max_bytes_per_token(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = backend if getattr(tokenizer, "is_fast", False) else None

    def check_size(self, text: str, param: str) -> None:
        """400 if the byte count alone proves `text` cannot fit the context."""
        per_token = self.max_bytes_per_token
        if per_token is None:
            return
        size = len(text.encode("utf-8"))
        at_least = math.ceil(size / per_token)
        if at_least >= self.max_model_len:
            raise bad_request(
                f"the prompt is {size} bytes, and this model's tokenizer puts at most "
                f"{per_token} bytes in a token, so it has at least {at_least} tokens, but "
                f"max_model_len is {self.max_model_len} and at least one token must be "
                "generated; shorten the prompt or raise --max-model-len",
                param,
            )

    def check_length(self, ids: list[int], param: str) -> None:
        """400 if a tokenized prompt leaves no room to generate within the context.

        The engine refuses it too; checked here, a huge prompt never travels to the engine
        thread."""
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, "
                "and at least one token must be generated; shorten the prompt or raise "
                "--max-model-len",
                param,
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as `tokenizer(text).input_ids` gives them (blocking)."""
        if self._fast is not None:
            (encoding,) = self._fast.encode_batch_fast(
                [text], add_special_tokens=add_special_tokens
            )
            return encoding.ids
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` on the pool."""
        return await self.pool.run(self.encode, text, add_special_tokens)

    async def tokenize_prompt(self, text: str, param: str) -> list[int]:
        """A prompt's ids (special tokens added); 400 when it is too long for the context,
        without tokenizing it when its size proves that."""
        self.check_size(text, param)
        ids = await self.tokenize(text)
        self.check_length(ids, param)
        return ids

    def info(self) -> dict[str, Any]:
        """GET /tokenizer_info: what a client needs to tokenize as the server does."""
        tokenizer = self.tokenizer
        special = ("bos_token", "eos_token", "pad_token", "unk_token")
        return {
            "tokenizer_class": type(tokenizer).__name__,
            **{name: getattr(tokenizer, name, None) for name in special},
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": self.max_model_len,
            "vocab_size": len(tokenizer),
        }
