"""#18.4: a checkpoint's own Python code never runs (and nobody is asked whether it should);
a shard index that points outside the checkpoint folder is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ssmserve.config import EngineConfig
from ssmserve.engine.engine import LLMEngine
from ssmserve.loader import checkpoint_files

ROOT = Path(__file__).resolve().parents[1]


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _plant(folder: Path, module: str, class_name: str, base: str) -> Path:
    """A module in the checkpoint that, imported, leaves a mark."""
    mark = folder / "CODE_RAN"
    (folder / f"{module}.py").write_text(
        f"open({str(mark)!r}, 'w').write('ran')\n"
        f"from transformers import {base}\n"
        f"class {class_name}({base}):\n    model_type = 'evil_bamba'\n"
    )
    return mark


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_config_that_needs_custom_code_fails_without_asking(checkpoint, tmp_path):
    folder = _copy(checkpoint("bamba"), tmp_path / "evil")
    mark = _plant(folder, "configuration_evil", "EvilConfig", "PretrainedConfig")
    _edit_json(
        folder / "config.json",
        model_type="evil_bamba",
        auto_map={"AutoConfig": "configuration_evil.EvilConfig"},
    )
    # Answering "y" to transformers' question would run the code: nothing may ask.
    proc = subprocess.run(
        [sys.executable, "-m", "ssmserve.cli", "generate", "--model", str(folder), "hi"],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stderr
    assert "never runs code from a checkpoint" in proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not mark.exists()


def test_tokenizer_that_needs_custom_code_fails(checkpoint, tmp_path):
    folder = _copy(checkpoint("bamba"), tmp_path / "evil-tokenizer")
    mark = _plant(folder, "tokenization_evil", "EvilTokenizer", "PreTrainedTokenizerFast")
    _edit_json(
        folder / "tokenizer_config.json",
        tokenizer_class="EvilTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
    )
    with pytest.raises(ValueError, match="never runs code from a checkpoint"):
        LLMEngine(EngineConfig(model=str(folder), device="cpu"))
    assert not mark.exists()


def _sharded(folder: Path, weight_file: str) -> None:
    names = load_file(str(folder / "model.safetensors")).keys()
    os.replace(folder / "model.safetensors", folder / "unused.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, weight_file)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "shard", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/passwd"]
)
def test_shard_index_pointing_outside_the_folder_is_refused(checkpoint, tmp_path, shard):
    folder = _copy(checkpoint("bamba"), tmp_path / "ckpt")
    shutil.copy(folder / "model.safetensors", tmp_path / "outside.safetensors")
    _sharded(folder, shard)
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        checkpoint_files(str(folder))


def test_symlinked_shards_as_in_the_hub_cache_load(checkpoint, tmp_path):
    # A hub cache snapshot holds symlinks into its blob store, outside the snapshot folder.
    folder = _copy(checkpoint("bamba"), tmp_path / "snapshot")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.copy(folder / "model.safetensors", blobs / "0123abcd")
    os.symlink(blobs / "0123abcd", folder / "model-00001-of-00001.safetensors")
    _sharded(folder, "model-00001-of-00001.safetensors")
    assert checkpoint_files(str(folder)) == [str(folder / "model-00001-of-00001.safetensors")]
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu"))
    assert engine.model_config.architecture == "BambaForCausalLM"
