"""Set up Triton kernel tests: interpreter on CPU, skip cleanly without Triton.

Import this module before anything that may import triton.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # NOTE: Triton reads this when kernels are decorated; ssmserve decorates lazily at
    # first launch, so setting it here works even if ssmserve.kernels was imported.
    os.environ["TRITON_INTERPRET"] = "1"

requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
