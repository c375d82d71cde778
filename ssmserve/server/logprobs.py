"""Logprobs in the two OpenAI shapes: the legacy completions lists and chat's content."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ssmserve.outputs import PositionLogprobs
from ssmserve.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


def token_text(token_id: int, entry: Any, tokenizer: Any) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id])


def top_entries(entry: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    """The `k` most likely (token id, Logprob) pairs of one position."""
    return sorted(entry.items(), key=lambda item: -item[1].logprob)[:k]


def legacy_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    top_n: int,
    tokenizer: Any,
    offset: int,
    into: CompletionLogprobs,
) -> int:
    """Append the completions-API logprobs of `token_ids` to `into`; return the next offset.

    Each position's `top_logprobs` holds its `top_n` most likely tokens and the chosen one.
    """
    for token_id, entry in zip(token_ids, positions, strict=False):
        if entry is None:  # the first prompt token has no logprob
            text = tokenizer.decode([token_id])
            into.token_logprobs.append(None)
            into.top_logprobs.append(None)
        else:
            chosen = entry.get(token_id)
            text = token_text(token_id, chosen, tokenizer)
            into.token_logprobs.append(chosen.logprob if chosen is not None else None)
            # The chosen token is always among them, as OpenAI documents: up to top_n + 1.
            ranked = top_entries(entry, top_n)
            if chosen is not None and all(t != token_id for t, _ in ranked):
                ranked.append((token_id, chosen))
            into.top_logprobs.append({token_text(t, lp, tokenizer): lp.logprob for t, lp in ranked})
        into.tokens.append(text)
        into.text_offset.append(offset)
        offset += len(text)
    return offset


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top_n: int, tokenizer: Any
) -> ChatLogprobs:
    """The chat-API logprobs of `token_ids`: each token with its `top_n` alternatives."""
    content = []
    for token_id, entry in zip(token_ids, positions, strict=False):
        chosen = entry.get(token_id)
        text = token_text(token_id, chosen, tokenizer)
        tops = [
            TopLogprob(
                token=(t := token_text(tid, lp, tokenizer)),
                logprob=lp.logprob,
                bytes=list(t.encode()),
            )
            for tid, lp in top_entries(entry, top_n)
        ]
        content.append(
            TokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=tops,
            )
        )
    return ChatLogprobs(content=content)
