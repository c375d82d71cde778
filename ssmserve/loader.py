"""Checkpoint weights (safetensors, single file or sharded) -> model parameters, by name."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import zlib

import torch
from safetensors import safe_open

from ssmserve.distributed.parallel import TensorParallel
from ssmserve.layers.linear import load_replicated
from ssmserve.models.base import CausalLM

logger = logging.getLogger(__name__)


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
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


@torch.no_grad()
def load_weights(model: CausalLM, path: str) -> None:
    """Load every checkpoint tensor through its parameter's `weight_loader`, which takes
    this rank's shard (checkpoint names map to parameters by the family's `name_rules`).

    Raises with the names when the checkpoint lacks parameters or has tensors the model
    does not know: a silent partial load would give plausible-looking garbage. Two
    tensors that load into the same parameter (copies of weights a model shares across
    depths) must be equal.
    """
    every = dict(model.named_parameters())
    # Parameters left on `meta` belong to other pipeline stages: not loaded here.
    params = {name: p for name, p in every.items() if not p.is_meta}
    needed = {name: set(getattr(p, "shard_ids", (None,))) for name, p in params.items()}
    loaded: dict[str, set[int | None]] = {}
    first_key: dict[tuple[str, int | None], str] = {}
    unexpected: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if any(key.endswith(k) for k in model.ignored_checkpoint_keys):
                    continue
                name, shard = model.checkpoint_to_param(key)
                param = params.get(name)
                if param is None:
                    if name in every:
                        continue  # another pipeline stage's weight
                    if key == "lm_head.weight" and model.tie_word_embeddings:
                        continue  # a tied checkpoint may still store the shared matrix
                    unexpected.append(key)
                    continue
                loader = getattr(param, "weight_loader", load_replicated)
                earlier = first_key.setdefault((name, shard), key)
                before = param.detach().clone() if earlier != key else None
                try:
                    loader(param, f.get_tensor(key), shard)
                except ValueError as exc:
                    raise ValueError(
                        f"weight {key} in {file} does not fit the model built from "
                        f"config.json: {exc}"
                    ) from exc
                if before is not None and not torch.equal(before, param):
                    raise ValueError(
                        f"checkpoint {path} holds {earlier} and {key}, which load into the "
                        f"same parameter ({name}), with different values; the model shares "
                        "that weight, so the checkpoint should hold one value for it"
                    )
                got = loaded.setdefault(name, set())
                got.update(needed[name] if shard is None else {shard})
    missing = sorted(
        {
            model.param_to_checkpoint(name, shard)
            for name, shards in needed.items()
            for shard in shards - loaded.get(name, set())
        }
    )
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


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights at real scale (`load_format="dummy"`): for speed and memory work,
    where weight values do not matter. Each whole (unsharded) tensor is drawn from a
    generator seeded by the seed and the parameter's name, then sharded by its
    weight_loader, so every tensor-parallel size sees the same model."""
    whole = _unsharded_shapes(model)
    for name, param in model.named_parameters():
        if param.is_meta:
            continue  # another pipeline stage's weight
        gen = torch.Generator(param.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        shape = whole[name]
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            # Decays exp(-dt * exp(A_log)) in a sane range, as trained SSMs have.
            full = torch.rand(shape, generator=gen, device=param.device).mul(3)
        elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
            full = torch.empty(shape, device=param.device).uniform_(-4.0, -2.0, generator=gen)
        elif leaf == "D" or "norm" in name:
            full = torch.ones(shape, device=param.device)
        elif leaf == "bias":
            full = torch.zeros(shape, device=param.device)
        else:
            std = 1.0 / shape[-1] ** 0.5 if len(shape) > 1 else 0.02
            full = torch.empty(shape, device=param.device).normal_(0.0, std, generator=gen)
        getattr(param, "weight_loader", load_replicated)(param, full.to(param.dtype), None)


def _unsharded_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the same model at tensor_parallel_size 1 (built on `meta`)."""
    if model.ctx.tp.size == 1:
        return {name: tuple(p.shape) for name, p in model.named_parameters()}
    with torch.device("meta"):
        whole = type(model)(model.hf_config, dataclasses.replace(model.ctx, tp=TensorParallel()))
    return {name: tuple(p.shape) for name, p in whole.named_parameters()}
