"""HF architecture name -> model class, imported lazily."""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, tuple[str, str]] = {
    "MambaForCausalLM": ("mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("mamba", "FalconMambaForCausalLM"),
    "Mamba2ForCausalLM": ("mamba2", "Mamba2ForCausalLM"),
    "BambaForCausalLM": ("bamba", "BambaForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Zamba2ForCausalLM": ("zamba2", "Zamba2ForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM"),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
}


def supported_architectures() -> list[str]:
    return list(_REGISTRY)


def model_class(architecture: str):
    if architecture not in _REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(sorted(_REGISTRY))
        )
    module, name = _REGISTRY[architecture]
    return getattr(importlib.import_module(f"ssmserve.models.{module}"), name)
