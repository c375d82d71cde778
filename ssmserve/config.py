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

from ssmserve.kernels import BACKENDS as KERNEL_BACKENDS

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "ssmserve-bamba-tiny"
DTYPES = ("auto", "float32", "bfloat16", "float16")
STATE_DTYPES = ("float32", "bfloat16", "float16", "auto")
LOAD_FORMATS = ("auto", "dummy")


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


# Files any of which means a folder carries its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_tokenizer_path(tokenizer: str | None, model_path: str, load_format: str) -> str:
    """The tokenizer folder: `tokenizer` if given, else the model's. A dummy-weight run of a
    folder that holds only config.json (benchmarks/configs/*) gets the bundled tokenizer,
    so real-size benchmarks run without the hub; its text is meaningless there."""
    if tokenizer is not None:
        return tokenizer
    has_own = any(os.path.isfile(os.path.join(model_path, f)) for f in TOKENIZER_FILES)
    if load_format == "dummy" and not has_own:
        logger.warning(
            "%s has no tokenizer files; with load_format=dummy the bundled tokenizer stands "
            "in (token-id prompts as usual, generated text is not meaningful)",
            model_path,
        )
        return bundled_model_path()
    return model_path


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
        eos = read_generation_config(path).get("eos_token_id", eos)
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


# generation_config.json fields that become sampling defaults, as vLLM's
# --generation-config auto takes them.
GENERATION_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(folder: str) -> dict[str, Any]:
    """The folder's generation_config.json, or {} when it has none."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def sampling_defaults_from(generation: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a generation config sets (vLLM's --generation-config auto)."""
    return {k: generation[k] for k in GENERATION_SAMPLING_FIELDS if generation.get(k) is not None}


def _flag(default: Any, help: str, **cli: Any) -> Any:
    """A config field with its command-line help (and argparse extras such as choices)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, flat, with its command-line flag (`--max-num-seqs` for
    `max_num_seqs`): the flags are generated from these fields by `add_engine_args`, so a
    new setting is one field here. Validated on construction; errors say what to change."""

    model: str | None = _flag(
        None, "checkpoint folder, cached hub id or bundled model name", cli=False
    )
    tokenizer: str | None = _flag(None, "tokenizer folder (default: the model's)")
    dtype: str = _flag(
        "auto",
        "weights/activations; auto = float32 on CPU, the checkpoint's 16-bit type on GPU",
        choices=DTYPES,
    )
    device: str = _flag("auto", "auto | cpu | cuda[:N]")
    max_model_len: int | None = _flag(
        None, "longest prompt + output, in tokens (default: the model's limit)"
    )
    max_num_seqs: int = _flag(256, "most requests running at once (one SSM state slot each)")
    max_num_batched_tokens: int | None = _flag(
        None,
        "token budget of one step; longer prompts are prefilled in chunks "
        "(default 8192 on GPU, 2048 on CPU)",
    )
    block_size: int = _flag(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = _flag(
        None, "override the number of KV-cache blocks the memory planner picks"
    )
    cache_memory: int | None = _flag(
        None, "bytes for KV blocks and state slots per rank (default on CPU: 256 MiB)"
    )
    gpu_memory_utilization: float = _flag(0.9, "fraction of each GPU's memory the engine may use")
    enforce_eager: bool = _flag(False, "disable CUDA graphs")
    overlap_steps: bool = _flag(
        True,
        "plan each step while the previous one runs and build outputs while the next one "
        "runs (--no-overlap-steps runs steps one after another)",
    )
    tensor_parallel_size: int = _flag(
        1, "GPUs (or CPU processes) the model is split across", aliases=("-tp",)
    )
    pipeline_parallel_size: int = _flag(
        1, "pipeline stages the layers are split into (processes: TP x PP)", aliases=("-pp",)
    )
    pp_layer_partition: str | None = _flag(
        None,
        "decoder layers per pipeline stage, comma-separated (e.g. 10,14,8); default: as "
        "even as possible",
    )
    mamba_ssm_cache_dtype: str = _flag(
        "float32",
        "dtype of the SSM state (float32 keeps long outputs exact; auto = the model dtype)",
        choices=STATE_DTYPES,
    )
    mamba_ssm_stochastic_rounding: bool = _flag(
        False,
        "round the SSM state stochastically (unbiased) when a decode step writes it into a "
        "16-bit mamba_ssm_cache_dtype; prefill writes round to nearest (docs/kernels.md)",
    )
    kernel_backend: str = _flag(
        "auto",
        "auto = PyTorch reference ops on CPU; on CUDA hopper (Triton + the Gluon SSD scan) "
        "on sm_90, else triton (docs/kernels.md)",
        choices=KERNEL_BACKENDS,
    )
    decode_pdl: bool | None = _flag(
        None,
        "decode with programmatic dependent launch: each kernel starts while the one before "
        "it runs and loads its weights (or state) first; the linears of one row use a Triton "
        "GEMV (default: on where it can run, an sm_90 GPU with Triton kernels; "
        "docs/kernels.md)",
    )
    generation_config: str = _flag(
        "auto",
        "where requests that leave temperature, top_p, top_k, min_p or repetition_penalty "
        "unset take them from: auto = the checkpoint's generation_config.json; vllm = the "
        "built-in defaults; or a folder holding a generation_config.json",
    )
    load_format: str = _flag(
        "auto",
        "auto = the checkpoint's safetensors; dummy = random weights of the right shapes "
        "(benchmarks)",
        choices=LOAD_FORMATS,
    )
    seed: int = _flag(0, "seed of the engine's sampling generator and of dummy weights")
    enable_prefix_caching: bool = _flag(
        True,
        "resume prompts from the KV blocks and SSM states of prefixes computed before "
        "(docs/prefix_caching.md)",
    )
    prefix_checkpoint_fraction: float = _flag(
        0.25,
        "share of the cache budget for SSM state checkpoints of prefix caching (models "
        "without attention give them all that the state slots leave)",
    )
    num_prefix_checkpoints: int | None = _flag(
        None, "override the number of SSM state checkpoints the memory planner picks"
    )
    prefix_checkpoint_interval: int | None = _flag(
        None,
        "tokens between SSM state checkpoints inside a prefill, a multiple of the SSD chunk "
        "(default: the SSD chunk, 256 for Mamba1 models)",
    )

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}"
                )
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_kv_blocks",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "max_model_len",
            "prefix_checkpoint_interval",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.cache_memory is not None and self.cache_memory < 1:
            raise ValueError(f"cache_memory must be a positive byte count, got {self.cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0.0 <= self.prefix_checkpoint_fraction < 1.0:
            raise ValueError(
                "prefix_checkpoint_fraction must be in [0, 1), got "
                f"{self.prefix_checkpoint_fraction}"
            )
        if self.mamba_ssm_stochastic_rounding and self.mamba_ssm_cache_dtype == "float32":
            raise ValueError(
                "mamba_ssm_stochastic_rounding rounds writes into a 16-bit SSM state, but "
                "mamba_ssm_cache_dtype is float32; set --mamba-ssm-cache-dtype bfloat16 or "
                "float16, or drop --mamba-ssm-stochastic-rounding"
            )
        if self.num_prefix_checkpoints is not None and self.num_prefix_checkpoints < 0:
            raise ValueError(
                f"num_prefix_checkpoints must be at least 0, got {self.num_prefix_checkpoints}"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        values.update(overrides)
        return cls(**values)


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per EngineConfig field (vLLM's names where the meaning is the same);
    `--model` is left to each command."""
    g = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        meta = dict(f.metadata)
        if meta.pop("cli", True) is False:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *meta.pop("aliases", ())]
        default = f.default
        help_text = meta.pop("help")
        if f.type in ("bool", bool, "bool | None"):
            g.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        kind = {"int": int, "int | None": int, "float": float}.get(str(f.type), str)
        shown = "" if default is None or "default" in help_text else f" (default: {default})"
        g.add_argument(*flags, type=kind, default=default, help=help_text + shown, **meta)
    return parser


def resolve_torch_dtype(dtype: str, device: str, hf_config: Any) -> str:
    """Pick the compute dtype: float32 on CPU for 'auto', the checkpoint's 16-bit type on GPU."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    ckpt = str(getattr(hf_config, "dtype", None) or "bfloat16").replace("torch.", "")
    return ckpt if ckpt in ("bfloat16", "float16") else "bfloat16"
