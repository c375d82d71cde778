"""Shared fixtures: tiny checkpoints per family, built once per session."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_checkpoint

# Each variant covers something the HF-parity tests must see: tied and untied
# embeddings, attention first and last, n_groups > 1, GQA and MQA, odd dimensions.
VARIANTS: dict[str, tuple[str, dict]] = {
    "bamba": ("bamba", {}),
    "bamba_attn_first_last_mqa": (
        "bamba",
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[0, 3],
            num_key_value_heads=1,
            tie_word_embeddings=True,
            hidden_size=42,
            num_attention_heads=3,
            mamba_n_heads=7,
            mamba_d_head=12,
            intermediate_size=70,
        ),
    ),
    "bamba_ngroups": ("bamba", dict(mamba_n_groups=2, mamba_d_state=10)),
    "mamba2": ("mamba2", {}),
    "mamba2_ngroups_odd": (
        "mamba2",
        dict(
            hidden_size=36,
            num_heads=3,
            head_dim=24,
            n_groups=3,
            state_size=7,
            tie_word_embeddings=True,
        ),
    ),
    "mamba": ("mamba", {}),
    "mamba_untied_odd": ("mamba", dict(hidden_size=30, state_size=5, tie_word_embeddings=False)),
    "falcon_mamba": ("falcon_mamba", {}),
    "llama": ("llama", {}),
    "llama_mqa_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> folder of the tiny checkpoint VARIANTS[name], built once."""
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            family, overrides = VARIANTS[name]
            path = tmp_path_factory.mktemp(name)
            cache[name] = make_tiny_checkpoint(str(path), family, seed=0, **overrides)
        return cache[name]

    return get
