"""ForwardBatch: the flat, variable-length batch one model forward runs on.

Built by the model runner from a StepPlan and passed explicitly to every layer (no global
forward context). Sequences are ordered decodes first: the first `num_decodes` sequences
have exactly one new token and an initial state, so SSM layers can take the one-token
update path for them and the varlen prefill path for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [S+1] int32, token offsets of each sequence
    seq_lens: torch.Tensor  # [S] int32, tokens in the cache after this step
    state_slots: torch.Tensor  # [S] int64, SSM state slot per sequence (-1 = padding)
    has_initial_state: torch.Tensor  # [S] bool, resume from the slot instead of zeros
    block_tables: torch.Tensor  # [S, max_blocks] int32, KV blocks per sequence
    slot_mapping: torch.Tensor  # [T] int64, KV cache position of each token (-1 = skip)
    logits_indices: torch.Tensor  # [K] int64, rows whose logits are wanted
    num_decodes: int  # leading sequences with one token and an initial state
    query_start_loc_p: torch.Tensor  # [S-num_decodes+1] int32, prefill part, rebased to 0
    # [S-num_decodes] absolute position of each prefill sequence's first new token (SSD
    # chunks align to it); None when every prefill starts at position 0.
    start_positions_p: torch.Tensor | None = None
    # Host copies, for choices made on the host (never under CUDA graphs, where they are
    # empty): token offsets of each sequence and the tokens each had computed before.
    query_start_loc_host: tuple[int, ...] = ()
    context_lens_host: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
