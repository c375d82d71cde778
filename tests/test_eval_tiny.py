"""scripts/eval_tiny.py's chat stop rate: measured with what a user of the model gets (its
generation_config.json defaults, made greedy), it names the repetition penalty it used,
and --repetition-penalty measures others beside it."""

from __future__ import annotations

import json
import shutil
import sys
from importlib import resources
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import eval_tiny  # noqa: E402

MAX_TOKENS = 24
PENALTY = 1.3


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The bundled Bamba with a repetition penalty in its generation_config.json."""
    bundled = Path(str(resources.files("ssmserve").joinpath("model_data", "ssmserve-bamba-tiny")))
    path = tmp_path_factory.mktemp("eval_tiny") / "model"
    shutil.copytree(bundled, path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["repetition_penalty"] = PENALTY
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def records() -> list[dict]:
    data = resources.files("ssmserve").joinpath("model_data", "heldout_prompts.json")
    return json.loads(data.read_text(encoding="utf-8"))["chat"][:4]


def replies(llm, records: list[dict], repetition_penalty: float) -> list[str]:
    from ssmserve import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=repetition_penalty
    )
    outputs = llm.chat([r["messages"] for r in records], params, use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def test_chat_stop_rate_samples_with_the_model_defaults_or_the_penalty_given(folder, records):
    from ssmserve import LLM

    llm = LLM(model=str(folder), dtype="float32", device="cpu")
    with_penalty = replies(llm, records, PENALTY)
    without = replies(llm, records, 1.0)
    assert with_penalty != without  # the penalty changes these replies

    default = eval_tiny.chat_stop_rate(llm, records, MAX_TOKENS)
    assert default["repetition_penalty"] == PENALTY
    assert [s["reply"] for s in default["samples"]] == with_penalty
    given = eval_tiny.chat_stop_rate(llm, records, MAX_TOKENS, repetition_penalty=1.0)
    assert given["repetition_penalty"] == 1.0
    assert [s["reply"] for s in given["samples"]] == without
    assert given["max_tokens"] == MAX_TOKENS and given["num_prompts"] == len(records)


def test_chat_only_command_writes_each_penalty(folder, records, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps(records[:2]))
    out = tmp_path / "result.json"
    argv = [str(folder), "--chat-only", "--chat", str(chat), "--chat-max-tokens", "8"]
    argv += ["--repetition-penalty", "1.0", "1.1", "--json-out", str(out)]
    assert eval_tiny.main(argv) == 0
    (result,) = json.loads(out.read_text())
    assert result["sets"] == {}
    assert result["chat"]["repetition_penalty"] == PENALTY
    swept = result["chat_by_repetition_penalty"]
    assert [c["repetition_penalty"] for c in swept] == [1.0, 1.1]
    assert all(c["num_prompts"] == 2 and c["max_tokens"] == 8 for c in swept)
