"""Checkpoint weights (safetensors, single file or sharded) -> model parameters, by name."""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open

from ssmserve.models.base import CausalLM

logger = logging.getLogger(__name__)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        outside = [s for s in shards if not _inside_folder(s)]
        if outside:
            raise ValueError(
                f"{index} names shard files outside the checkpoint folder "
                f"({', '.join(map(repr, outside[:3]))}); ssmserve reads only files inside "
                "it. Fix the index or re-download the checkpoint"
            )
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(
                f"{path} lists shards that are not there: {', '.join(missing)}; "
                "re-download the checkpoint"
            )
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {path}; ssmserve loads "
        "safetensors checkpoints (convert .bin files with transformers' save_pretrained)"
    )


def _inside_folder(name: str) -> bool:
    """A shard name from an index stays inside the folder: relative, no `..` part.

    Checked on the name, not the resolved path: a Hugging Face cache snapshot's files are
    symlinks into its blob store, outside the snapshot folder, and are fine.
    """
    if os.path.isabs(name) or os.path.splitdrive(name)[0]:
        return False
    return ".." not in name.replace("\\", "/").split("/")


@torch.no_grad()
def load_weights(model: CausalLM, path: str) -> None:
    """Copy every checkpoint tensor into the parameter of the same name.

    Raises with the names when the checkpoint lacks parameters or has tensors the model
    does not know: a silent partial load would give plausible-looking garbage.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if any(name.endswith(k) for k in model.ignored_checkpoint_keys):
                    continue
                param = params.get(name)
                if param is None:
                    if name == "lm_head.weight" and model.tie_word_embeddings:
                        continue  # a tied checkpoint may still store the shared matrix
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)} in {file} but the "
                        f"model built from config.json expects {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(
                f"missing from the checkpoint: {', '.join(missing[:10])}"
                + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            )
        if unexpected:
            parts.append(
                f"not used by the model: {', '.join(sorted(unexpected)[:10])}"
                + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else "")
            )
        raise ValueError(
            f"checkpoint {path} does not match its config.json ({'; '.join(parts)}); "
            "check that config.json and the weights come from the same model"
        )
    model.tie_weights_if_needed()


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights at real scale (`load_format="dummy"`): for speed and memory work,
    where weight values do not matter. Deterministic for a given seed and device."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            # Decays exp(-dt * exp(A_log)) in a sane range, as trained SSMs have.
            param.copy_(torch.rand(param.shape, generator=gen, device=param.device).mul(3))
        elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
            param.uniform_(-4.0, -2.0, generator=gen)
        elif leaf == "D" or "norm" in name:
            param.fill_(1.0)
        elif leaf == "bias":
            param.zero_()
        else:
            fan_in = param.shape[-1] if param.ndim > 1 else 1
            param.normal_(0.0, 1.0 / fan_in**0.5 if param.ndim > 1 else 0.02, generator=gen)
    model.tie_weights_if_needed()
