"""What the Triton kernel tests share: the device they run on, a skip without Triton.

Without a GPU the tests run in Triton's CPU interpreter: conftest.py switches it on
around every test (tests/triton_interpreter.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
