"""Gated, optionally grouped RMSNorm used after the Mamba2 scan.

norm_before_gate=False (Mamba2 / Bamba):  y = weight * rmsnorm(x * silu(z))
norm_before_gate=True:                    y = weight * rmsnorm(x) * silu(z)

rmsnorm normalises each group of `group_size` consecutive channels (the whole row
when None) in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmserve.kernels._common import check_shape


def _check_norm_args(
    x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor | None, group_size: int | None
) -> tuple[int, int, int]:
    check_shape("x", x, [None, None])
    T, Dm = x.shape
    check_shape("weight", weight, [Dm])
    if z is not None:
        check_shape("z", z, [T, Dm])
    group = Dm if group_size is None else group_size
    if group <= 0 or Dm % group != 0:
        raise ValueError(f"group_size ({group_size}) must divide the hidden size ({Dm})")
    return T, Dm, group


def gated_rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    *,
    eps: float,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated grouped RMSNorm in PyTorch.

    Matches Hugging Face's BambaRMSNormGated / MambaRMSNormGated exactly when
    group_size is None and norm_before_gate is False: the normalised value is cast to
    x.dtype before the weight multiply.

    Args:
        x: [T, Dm]. weight: [Dm]. z: [T, Dm] gate or None.
        eps: added to the mean square. group_size: channels per group (None = Dm).

    Returns:
        y: [T, Dm] in x.dtype.
    """
    T, Dm, group = _check_norm_args(x, weight, z, group_size)
    dtype = x.dtype
    h = x.float()
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.float())
    h = h.view(T, Dm // group, group)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.view(T, Dm)
    if z is not None and norm_before_gate:
        h = h * F.silu(z.float())
    return (weight * h.to(dtype)).to(dtype)
