"""The sampler's two-launch draw (kernels/sampling.py) against the sampler's tensor ops:
the same tokens (ties to the first index), the same raw logprobs up to the sum's order."""

from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE, requires_triton

from ssmserve.engine.sampler import Sampler, SamplingRow
from ssmserve.kernels.sampling import CHUNK, draw_ref, draw_triton
from ssmserve.sampling_params import SamplingParams


def logits_with_ties(B: int, V: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=gen) * 3
    # Row 0's maximum twice, in two chunks, the later one written first in memory order
    # of the chunks' programs: the first index must win.
    top = logits[0].max() + 1
    logits[0, V - 5] = top
    logits[0, 7] = top
    return logits.to(DEVICE)


@requires_triton
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("V", [CHUNK * 2 + 37, 300])
def test_draw_gives_the_tensor_ops_tokens_and_logprobs(sampled, V):
    logits = logits_with_ties(3, V, seed=V)
    temps = noise = None
    if sampled:
        gen = torch.Generator().manual_seed(1)
        temps = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float64).to(DEVICE)
        noise = torch.empty(3, V).exponential_(generator=gen).to(DEVICE)
        noise[1, 3] = 0.0  # clamped to the smallest normal float before the log
    want_ids, want = draw_ref(logits, temps, noise)
    got_ids, got = draw_triton(logits, temps, noise)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got[:3], want[:3])
    torch.testing.assert_close(got[3:], want[3:], rtol=0, atol=1e-5)
    if not sampled:
        assert int(got_ids[0]) == 7


@requires_triton
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_takes_the_draw_for_plain_rows_with_the_same_noise(temperature):
    """Plain rows (greedy, or all drawn from the generator with a temperature): the
    sampler's result is the draw's over the noise the same generator gives."""
    V = 700
    logits = logits_with_ties(2, V, seed=3)
    params = SamplingParams(temperature=temperature, max_tokens=4)
    rows = [SamplingRow(params, 0, [1, 2], []) for _ in range(2)]
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    out = Sampler()(logits, rows, gen)
    temps = noise = None
    if temperature:
        temps = torch.full((2,), temperature, dtype=torch.float64, device=DEVICE)
        gen = torch.Generator(device=DEVICE).manual_seed(5)
        noise = torch.empty(2, V, device=DEVICE).exponential_(generator=gen)
    ids, packed = draw_ref(logits, temps, noise)
    assert out.token_ids == ids.tolist()
    assert out.logprobs == pytest.approx(packed[2:].tolist(), abs=1e-5)


def test_draw_refuses_half_a_sampled_draw():
    logits = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="both temps and noise"):
        draw_triton(logits, torch.ones(1, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="float32"):
        draw_triton(logits.double(), None, None)
