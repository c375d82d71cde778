"""ssmserve: inference and serving for state-space and hybrid language models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

# Imported on first use, so `import ssmserve.scheduler` stays free of torch.
_LAZY = {
    "LLM": "ssmserve.llm",
    "SamplingParams": "ssmserve.sampling_params",
    "RequestOutput": "ssmserve.outputs",
    "CompletionOutput": "ssmserve.outputs",
    "Logprob": "ssmserve.outputs",
}

if TYPE_CHECKING:
    from ssmserve.llm import LLM
    from ssmserve.outputs import CompletionOutput, Logprob, RequestOutput
    from ssmserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ssmserve' has no attribute {name!r}")
