"""Incremental detokenization, and stop strings on the growing text."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Decoding token by token splits multi-byte characters and drops the spaces some
    tokenizers add between tokens, so each step decodes a short window of recent tokens
    and emits what the newest tokens added to it. Text that ends in an incomplete UTF-8
    sequence (U+FFFD) is held back until the next token completes it.
    """

    # Tokens of left context decoded with each window; enough for any merge we know of.
    CONTEXT = 6

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT :])
        self.read_offset = len(self.ids)  # ids before this are already emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (maybe empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[: self.read_offset])
        full = self._decode(self.ids)
        if full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the token that completes it
        delta = full[len(prefix) :]
        # Keep CONTEXT tokens of left context for the next window; drop older ids.
        keep_from = max(len(self.ids) - self.CONTEXT, 0)
        self.ids = self.ids[keep_from:]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last `new_len` characters of text.

    Returns (index where it starts, the stop string) or None.
    """
    best = None
    for stop in stops:
        start = max(len(text) - new_len - len(stop) + 1, 0)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
