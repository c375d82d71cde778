"""ssmserve: inference and serving for state-space and hybrid language models."""

from ssmserve.llm import LLM
from ssmserve.outputs import CompletionOutput, Logprob, RequestOutput
from ssmserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
