"""GPU memory profiling: the activation peak of a real forward at the full token budget."""

from __future__ import annotations

import torch

from ssmserve.layers.batch import StepInputs


@torch.inference_mode()
def profile_activation_peak(runner, num_tokens: int) -> int:
    """Bytes a forward of one `num_tokens`-token prefill needs beyond weights and caches.

    Runs `runner` (a ModelRunner) with caches just large enough for that one sequence
    (1 state slot), then frees them, so SSM intermediates, attention scratch and logits
    are all counted.
    """
    device = runner.device
    num_blocks = -(-num_tokens // runner.block_size)
    runner.allocate_caches(num_kv_blocks=num_blocks, num_state_slots=1)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    inputs = StepInputs(logits_indices=[num_tokens - 1])
    inputs.add_sequence([0] * num_tokens, 0, list(range(num_blocks)), runner.block_size, 0)
    received = None
    if runner.stage is not None and not runner.stage.is_first:
        received = {k: t.zero_() for k, t in runner.intermediate_buffers(num_tokens).items()}
    runner.execute(inputs.pack(), received)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    runner.release_caches()
    torch.cuda.empty_cache()
    return int(peak)
