"""GPU memory profiling: the activation peak of a real forward at the full token budget."""

from __future__ import annotations

import torch

from ssmserve.layers.batch import ForwardBatch
from ssmserve.models.base import CausalLM


@torch.inference_mode()
def profile_activation_peak(
    model: CausalLM, device: torch.device, num_tokens: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes a forward of one `num_tokens`-token prefill needs beyond weights and caches.

    Runs with caches just large enough for that one sequence (1 state slot), then frees
    them, so SSM intermediates, attention scratch and logits are all counted.
    """
    num_blocks = -(-num_tokens // block_size)
    model.allocate_caches(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        num_state_slots=1,
        dtype=dtype,
        state_dtype=torch.float32,
        device=device,
    )
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    positions = torch.arange(num_tokens, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device),
        positions=positions,
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        state_slots=torch.zeros(1, dtype=torch.long, device=device),
        has_initial_state=torch.zeros(1, dtype=torch.bool, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=positions.clone(),
        logits_indices=torch.tensor([num_tokens - 1], device=device),
        num_decodes=0,
        query_start_loc_p=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )
    hidden = model(batch)
    model.compute_logits(hidden[batch.logits_indices])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden
    model.release_caches()
    torch.cuda.empty_cache()
    return int(peak)
