"""Shared fixtures: tiny checkpoints per family, built once per session."""

from __future__ import annotations

import os

import pytest

from tests.tiny_models import make_tiny_checkpoint

# What the processes started from here (the pytest-xdist workers, torchrun ranks, servers)
# start with; the variables are read at process start, so not by this process.
# - One intra-op thread: two workers share the two cores of the CI machine, and with two
#   threads each the idle threads spin (tests/test_engine.py under -n 2 on this 2-core
#   machine: 220 s with neither setting, 190 s with the next one alone, 38 s with both).
# - glibc keeps freed memory for reuse: the tests allocate and free large CPU tensors every
#   step (the PyTorch twins' intermediates: 200 MB at a time in Mamba1's scan), and by
#   default glibc returns blocks over 32 MB to the kernel at each free and trims the heap's
#   top, so each new one faults its pages in again (test_engine.py serially: 79 of 116 s in
#   the kernel, 2 s with this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(
    "GLIBC_TUNABLES",
    "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=1073741824",
)

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
