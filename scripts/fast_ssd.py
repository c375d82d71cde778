"""A lean stand-in for transformers' torch Mamba2 chunked scan, for training only.

transformers' reference ``mamba2_chunk_scan`` (its path when ``mamba_ssm`` is not
installed) contracts by broadcasting and summing, materialising tensors of shape
(batch, chunks, chunk, chunk, heads, head_dim): gigabytes per layer at training
batch sizes. This module computes the same function (the SSD chunked form) with
einsum contractions, and builds the intra-chunk decay from differences of one
cumulative sum, so that each (chunk x chunk) tensor is made once. ``installed``
swaps it in while training; the parameters, and so the checkpoints, are
transformers' own, and evaluation and the tests run transformers' own code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def _decay_matrix(cumsum: torch.Tensor) -> torch.Tensor:
    """[..., T] cumulative sums -> [..., T, T]: exp(cumsum[i] - cumsum[j]) for j <= i, else 0."""
    length = cumsum.size(-1)
    causal = torch.ones(length, length, device=cumsum.device, dtype=torch.bool).tril()
    # NOTE: masked before exp: above the diagonal the difference is positive and can overflow.
    diff = (cumsum[..., :, None] - cumsum[..., None, :]).masked_fill(~causal, -torch.inf)
    return torch.exp(diff)


def mamba2_chunk_scan_einsum(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs,
):
    """Same signature and result as transformers' ``mamba2_chunk_scan``.

    hidden_states [b, t, h, p], dt [b, t, h], A [h], B and C [b, t, g, n];
    initial_states [b, h, p, n]. Returns y [b, t, h, p] (and the final state).
    """
    batch_size, seq_len, num_heads, head_dim = hidden_states.shape
    num_groups = B.shape[2]
    # float32 at least (bf16 inputs under autocast); float64 stays float64 for exact checks.
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).to(dtype)

    x = hidden_states.to(dtype)
    B = B.to(dtype).repeat_interleave(num_heads // num_groups, dim=2)
    C = C.to(dtype).repeat_interleave(num_heads // num_groups, dim=2)
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    D_residual = D[..., None] * x if D is not None else None

    x = x * dt[..., None]
    A_dt = A.to(dtype) * dt

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad))
        return t.reshape(batch_size, -1, chunk_size, *t.shape[2:])

    x, A_dt, B, C = chunks(x), chunks(A_dt), chunks(B), chunks(C)  # [b, c, l, ...]
    A_cumsum = torch.cumsum(A_dt.permute(0, 3, 1, 2), dim=-1)  # [b, h, c, l]

    # Diagonal blocks: y[l] = sum_{s <= l} C[l].B[s] * exp(A[s+1..l]) * x[s].
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * _decay_matrix(A_cumsum)
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x)

    # States at the end of each chunk, then carried across chunks.
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [b, h, c, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, x)
    if initial_states is None:
        initial = torch.zeros_like(states[:, :1])
    else:
        initial = initial_states[:, None].to(states.dtype)
    states = torch.cat([initial, states], dim=1)
    chunk_cumsum = torch.cumsum(F.pad(A_cumsum[..., -1], (1, 0)), dim=-1)  # [b, h, c + 1]
    new_states = torch.einsum("bhzc,bchpn->bzhpn", _decay_matrix(chunk_cumsum), states)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    # Off-diagonal blocks: the carried-in state read out through C.
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    y = y.reshape(batch_size, -1, num_heads, head_dim)[:, :seq_len]
    if D_residual is not None:
        y = y + D_residual
    if return_final_states:
        return y, final_state
    return y


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Route transformers' Mamba2 and Bamba mixers through the einsum scan, then restore."""
    from transformers.models.bamba import modeling_bamba
    from transformers.models.mamba2 import modeling_mamba2

    modules = (modeling_mamba2, modeling_bamba)
    originals = [module.mamba2_chunk_scan for module in modules]
    for module in modules:
        module.mamba2_chunk_scan = mamba2_chunk_scan_einsum
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.mamba2_chunk_scan = original
