"""EngineConfig (flat, validated) and ModelConfig (what the engine needs from a checkpoint)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "ssmserve-bamba-tiny"
DTYPES = ("auto", "float32", "bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16", "float16", "auto")


def bundled_model_names() -> list[str]:
    """Names of the models shipped inside the installed package (`--model NAME` loads one)."""
    root = resources.files("ssmserve").joinpath("model_data")
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.joinpath("config.json").is_file())


def bundled_model_path(name: str = DEFAULT_MODEL_NAME) -> str:
    """Folder of a model shipped inside the installed package."""
    path = resources.files("ssmserve").joinpath("model_data", name)
    if not path.is_dir():
        raise FileNotFoundError(
            f"the bundled model {name!r} is not in this installation of ssmserve ({path}); "
            "reinstall the package or pass --model PATH"
        )
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """A local folder, a bundled model's name, a hub id already in the local Hugging Face
    cache, or (None) the default bundled model."""
    if model is None:
        return bundled_model_path()
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(
                f"{model!r} is a folder but has no config.json; point --model at a Hugging Face "
                "checkpoint folder (config.json, *.safetensors, tokenizer files)"
            )
        return model
    bundled = bundled_model_names()
    if model in bundled:
        return bundled_model_path(model)
    if model.count("/") == 1 and not model.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(model, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means "not cached"
            raise FileNotFoundError(
                f"model {model!r} is neither a local folder nor in the local Hugging Face cache; "
                f"download it first (hf download {model}) or pass a folder path"
            ) from exc
    raise FileNotFoundError(
        f"model folder {model!r} does not exist; pass a checkpoint folder, a cached hub id, or "
        f"a bundled model ({', '.join(bundled)})"
    )


def _load_without_code(load: Callable[..., Any], path: str, what: str) -> Any:
    """`load(path)` with transformers told never to run (or ask to run) checkpoint code."""
    try:
        return load(path, trust_remote_code=False)
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ValueError(
            f"the checkpoint {path} needs its own Python code to load its {what} (auto_map); "
            "ssmserve never runs code from a checkpoint. Use a checkpoint whose model and "
            "tokenizer transformers supports natively"
        ) from None


def load_hf_config(path: str) -> Any:
    """transformers' config of a checkpoint, never running its code."""
    from transformers import AutoConfig

    return _load_without_code(AutoConfig.from_pretrained, path, "config")


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, never running its code."""
    from transformers import AutoTokenizer

    return _load_without_code(AutoTokenizer.from_pretrained, path, "tokenizer")


@dataclass
class ModelConfig:
    """The checkpoint: its path, HF config and architecture, and what the engine derives."""

    path: str
    architecture: str
    hf_config: Any  # transformers PretrainedConfig
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, path: str, max_model_len: int | None = None) -> ModelConfig:
        from ssmserve.models.registry import supported_architectures

        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        archs = raw.get("architectures") or []
        supported = supported_architectures()
        arch = next((a for a in archs if a in supported), None)
        if arch is None:
            raise ValueError(
                f"architecture {archs or 'missing'} of {path} is not supported; supported: "
                + ", ".join(sorted(supported))
            )
        hf_config = load_hf_config(path)
        eos = raw.get("eos_token_id")
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Attention layers have a trained position range; pure SSMs have none.
        limit = raw.get("max_position_embeddings") or 131072
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        return cls(
            path=path,
            architecture=arch,
            hf_config=hf_config,
            max_model_len=max_model_len,
            vocab_size=raw["vocab_size"],
            eos_token_ids=eos_ids,
        )


@dataclass
class EngineConfig:
    """Every engine setting, flat. Validated on construction; errors say what to change."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    mamba_ssm_cache_dtype: str = "float32"
    kernel_backend: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype must be one of {STATE_DTYPES}, "
                f"got {self.mamba_ssm_cache_dtype!r}"
            )
        if self.kernel_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                f"kernel_backend must be auto, triton or torch, got {self.kernel_backend!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(
                f"load_format must be auto (the checkpoint's safetensors) or dummy (random "
                f"weights, for benchmarks), got {self.load_format!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported yet; run with --tensor-parallel-size 1"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        values.update(overrides)
        return cls(**values)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Engine flags, under vLLM's names where the meaning is the same (--model not included)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights/activations; auto = float32 on CPU, the checkpoint's 16-bit type on GPU",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output, in tokens (default: the model's limit)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="most requests running at once (one SSM state slot each)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one step; longer prompts are prefilled in chunks",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="override the number of KV-cache blocks the memory planner picks",
    )
    g.add_argument(
        "--cache-memory",
        type=int,
        default=None,
        help="bytes for KV blocks and state slots (CPU; default 256 MiB)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory the engine may use",
    )
    g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs per model (only 1 for now)"
    )
    g.add_argument(
        "--mamba-ssm-cache-dtype",
        default="float32",
        choices=STATE_DTYPES,
        help="dtype of the SSM state (float32 keeps long outputs exact)",
    )
    g.add_argument(
        "--kernel-backend",
        default="auto",
        choices=("auto", "triton", "torch"),
        help="auto = Triton on CUDA, the PyTorch twins on CPU",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy = random weights of the right shapes (benchmarks)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    return parser


def resolve_torch_dtype(dtype: str, device: str, hf_config: Any) -> str:
    """Pick the compute dtype: float32 on CPU for 'auto', the checkpoint's 16-bit type on GPU."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    ckpt = str(getattr(hf_config, "dtype", None) or "bfloat16").replace("torch.", "")
    return ckpt if ckpt in ("bfloat16", "float16") else "bfloat16"
