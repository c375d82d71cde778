"""ssmserve: inference and serving for state-space and hybrid language models."""

__version__ = "0.1.0"
