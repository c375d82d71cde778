"""Kernel tests run the Triton kernels on the GPU, or in the CPU interpreter without one."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.triton_interpreter import interpreter_mode


@pytest.fixture(autouse=True)
def triton_interpreter_without_gpu():
    """TRITON_INTERPRET=1 for the test where there is no CUDA GPU, restored after it."""
    context = contextlib.nullcontext() if torch.cuda.is_available() else interpreter_mode()
    with context:
        yield
