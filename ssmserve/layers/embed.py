"""Vocab-parallel embedding and LM head.

The vocabulary is padded to a multiple of the tensor-parallel size and each rank holds
one contiguous block of rows. Pad rows are zero in the embedding and their logits are
cut off after the gather, so a pad id is never sampled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.layers.linear import linear


def _load_vocab_rows(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None) -> None:
    if shard_id is not None:
        raise ValueError(f"a vocab-parallel weight has no shard {shard_id!r}")
    vocab, start = param.vocab_size, param.vocab_start
    if loaded.shape[0] != vocab or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"shape {tuple(loaded.shape)} in the checkpoint, expected ({vocab}, "
            f"{', '.join(map(str, param.shape[1:]))})"
        )
    n = max(min(vocab - start, param.shape[0]), 0)
    param.data[:n].copy_(loaded[start : start + n])
    param.data[n:].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab_size = -(-vocab_size // tp.size) * tp.size
        rows = self.padded_vocab_size // tp.size
        self.vocab_start = tp.rank * rows
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)
        self.weight.vocab_size = vocab_size
        self.weight.vocab_start = self.vocab_start
        self.weight.weight_loader = _load_vocab_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the whole vocabulary: each rank computes its block, then all-gather.

    With tied embeddings pass the embedding: the head shares its (identically sharded)
    weight parameter, so `named_parameters()` lists it once, under the embedding.
    """

    decode_gemv: Callable[..., torch.Tensor] | None = None
    # The dtype of one row's logits: float32, rounded to the weight's dtype first as
    # F.linear's are (the one-row GEMV of batch-1 decode stores them so, with no cast
    # launch). None keeps the weight's dtype, for a family that scales its logits in that
    # dtype, as transformers does. More rows keep the weight's dtype (half the bytes to
    # gather across ranks); the model runner widens them.
    out_dtype: torch.dtype | None = torch.float32

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        tied: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        source = tied if tied is not None else VocabParallelEmbedding(vocab_size, hidden_size, tp)
        self.weight = source.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out_dtype = self.out_dtype if hidden.shape[0] == 1 else None
        local = linear(hidden, self.weight, None, self.decode_gemv, out_dtype)
        logits = self.tp.all_gather(local)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]
