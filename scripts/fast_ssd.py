"""A memory-lean stand-in for transformers' torch Mamba2 chunked scan, for training only.

transformers' reference ``mamba2_chunk_scan`` (used when ``mamba_ssm`` is not
installed) contracts by broadcasting and summing, materialising tensors of shape
(batch, chunks, chunk, chunk, heads, head_dim): gigabytes per layer at training
batch sizes, slow on CPU and GPU alike. This module computes the same function
with einsum contractions and is swapped in by ``train_tiny.py`` while training.
The checkpoints are unaffected (the parameters are the same); evaluation and the
tests run transformers' own code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, else -inf."""
    length = x.size(-1)
    x = x[..., None].expand(*x.shape, length)
    below = torch.tril(torch.ones(length, length, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~below, 0)
    sums = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(length, length, device=x.device, dtype=torch.bool), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


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

    hidden_states [b, t, h, p], dt [b, t, h], A [h], B and C [b, t, g, n].
    """
    batch_size, seq_len, num_heads, head_dim = hidden_states.shape
    num_groups = B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()

    x = hidden_states.float()
    B = B.float().repeat_interleave(num_heads // num_groups, dim=2)
    C = C.float().repeat_interleave(num_heads // num_groups, dim=2)
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    D_residual = D[..., None] * x if D is not None else None

    x = x * dt[..., None]
    A_dt = A.float() * dt

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad))
        return t.reshape(batch_size, -1, chunk_size, *t.shape[2:])

    x, A_dt, B, C = chunks(x), chunks(A_dt), chunks(B), chunks(C)  # [b, c, l, ...]
    A_dt = A_dt.permute(0, 3, 1, 2)  # [b, h, c, l]
    A_cumsum = torch.cumsum(A_dt, dim=-1)

    # Diagonal blocks: y[l] = sum_s C[l].B[s] * exp(A[s+1..l]) * x[s].
    L = torch.exp(_segment_sum(A_dt))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * L
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, x)

    # States at the end of each chunk, then carried across chunks.
    decay_states = torch.exp(A_cumsum[..., -1:] - A_cumsum)  # [b, h, c, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, x)
    if initial_states is None:
        initial = torch.zeros_like(states[:, :1])
    else:
        initial = initial_states[:, None].to(states.dtype)
    states = torch.cat([initial, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[..., -1], (1, 0))))  # [b, h, z, c]
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    # Off-diagonal blocks: the carried-in state read out through C.
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cumsum))
    y = (y_diag + y_off).reshape(batch_size, -1, num_heads, head_dim)[:, :seq_len]
    if D_residual is not None:
        y = y + D_residual
    if return_final_states:
        return y, final_state
    return y


def install() -> None:
    """Route transformers' Mamba2 and Bamba mixers through the einsum scan."""
    from transformers.models.bamba import modeling_bamba
    from transformers.models.mamba2 import modeling_mamba2

    modeling_mamba2.mamba2_chunk_scan = mamba2_chunk_scan_einsum
    modeling_bamba.mamba2_chunk_scan = mamba2_chunk_scan_einsum
