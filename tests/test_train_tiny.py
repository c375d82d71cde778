"""The scripts that build the bundled models' data and train them (scripts/*_tiny.py).

The training run happens once, on a GPU lent for a few minutes: these pin, on CPU,
what that run relies on. The training scan equals a step-by-step recurrence; chat
conversations tokenize exactly as inference will see them; held-out code cannot
leak into training; and a short time-bounded run saves loadable bf16 checkpoints
as it goes and evaluates what it saved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ssmserve

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import fast_ssd  # noqa: E402
import install_tiny  # noqa: E402
import tiny_chat  # noqa: E402
import tiny_corpus  # noqa: E402
import tiny_synth  # noqa: E402
import tiny_trainer  # noqa: E402
import train_tiny  # noqa: E402

BUNDLED_TOKENIZER = train_tiny.BUNDLED_TOKENIZER

SOURCE = '''"""A module."""


def add(a, b=1):
    """Return the sum of a and b."""
    total = a + b
    return total


class Stack:
    def pop(self):
        """Remove and return the top item."""
        return self.items.pop()


def undocumented(x):
    return x
'''


def sequential_scan(x, dt, A, B, C, D, dt_bias, initial_state):
    """The Mamba2 recurrence one token at a time: h = exp(dt A) h + dt B x; y = C h + D x."""
    batch, length, heads, head_dim = x.shape
    groups = B.shape[2]
    dt = torch.nn.functional.softplus(dt + dt_bias)
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    state = initial_state.clone()
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = state * decay + dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("length,chunk,groups", [(50, 16, 2), (64, 16, 1), (33, 8, 1)])
def test_training_scan_equals_the_sequential_recurrence(length, chunk, groups):
    gen = torch.Generator().manual_seed(length)
    batch, heads, head_dim, state_size = 2, 4, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    inputs = dict(
        hidden_states=rand(batch, length, heads, head_dim),
        dt=rand(batch, length, heads),
        A=(-0.5 - 8 * torch.rand(heads, generator=gen, dtype=torch.float64)).requires_grad_(),
        B=rand(batch, length, groups, state_size),
        C=rand(batch, length, groups, state_size),
        D=rand(heads),
        dt_bias=rand(heads),
    )
    initial = torch.randn(batch, heads, head_dim, state_size, generator=gen, dtype=torch.float64)
    y, final = fast_ssd.mamba2_chunk_scan_einsum(
        **inputs,
        chunk_size=chunk,
        dt_softplus=True,
        initial_states=initial,
        return_final_states=True,
    )
    y_ref, final_ref = sequential_scan(*inputs.values(), initial)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((y * weights).sum(), list(inputs.values()))
    grads_ref = torch.autograd.grad((y_ref * weights).sum(), list(inputs.values()))
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_training_scan_matches_transformers_reference_scan():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    gen = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, 70, 4, 8, generator=gen),
        dt=torch.randn(2, 70, 4, generator=gen),
        A=-0.5 - 8 * torch.rand(4, generator=gen),
        B=torch.randn(2, 70, 1, 16, generator=gen),
        C=torch.randn(2, 70, 1, 16, generator=gen),
        D=torch.randn(4, generator=gen),
        dt_bias=torch.randn(4, generator=gen),
    )
    ours = fast_ssd.mamba2_chunk_scan_einsum(**inputs, chunk_size=16, dt_softplus=True)
    theirs = mamba2_chunk_scan(**inputs, chunk_size=16, dt_softplus=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_docstring_sentences_become_requests():
    assert tiny_chat.summary_forms("Return the sum of a and b.\n\nMore.") == (
        "return the sum of a and b",
        "returns the sum of a and b",
    )
    assert tiny_chat.summary_forms("Applies f to every item. Then stops.") == (
        "apply f to every item",
        "applies f to every item",
    )
    assert tiny_chat.summary_forms("Remove and return the top item.")[1] == (
        "removes and returns the top item"
    )
    assert tiny_chat.summary_forms("The median of the data.") is None  # no verb to ask with
    functions = tiny_chat.extract_functions("m.py", SOURCE)
    assert [(f.cls, f.name, f.signature) for f in functions] == [
        (None, "add", "add(a, b=1)"),
        ("Stack", "pop", "pop(self)"),
    ]
    assert functions[0].code_without_docstring == (
        "def add(a, b=1):\n    total = a + b\n    return total"
    )


def test_chat_conversations_tokenize_as_inference_sees_them():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    conversations = tiny_chat.training_conversations({"m.py": SOURCE}, small_talk_copies=1)
    assert len(conversations) >= 2 + len(tiny_chat.SMALL_TALK)
    # Raises unless each prompt (all but the last turn, plus the generation prompt) is a
    # token prefix of its conversation, and the conversation ends with EOS.
    encoded = train_tiny.encode_conversations(tokenizer, conversations)
    replies = [c[-1]["content"] for c in conversations]
    assert any(r.startswith("```python\ndef add(a, b=1):") for r in replies)
    for ids, conversation in zip(encoded, conversations):
        text = tokenizer.decode(ids)
        assert text.endswith(conversation[-1]["content"] + "\n")  # the EOS follows in the stream
        assert text.count("<|assistant|>") == sum(m["role"] == "assistant" for m in conversation)


def _variant_sources(task):
    """Every (name, args, body) combination of a synthetic task, rendered with examples."""
    for name in task.names:
        for args in task.args:
            for body in task.bodies:
                yield name, tiny_synth.render(task, name, args, task.says[0], body, True)[0]


@pytest.mark.parametrize("task", tiny_synth.TASKS, ids=lambda t: t.names[0])
def test_synthetic_functions_compute_their_reference(task):
    """Every way a synthetic task is written returns what its reference does on every
    sample, and the doctest examples it shows are true (run by doctest)."""
    import copy
    import doctest

    for name, source in _variant_sources(task):
        namespace = {}
        exec(compile(source, f"<{name}>", "exec"), namespace)
        for sample in task.samples:
            assert namespace[name](*copy.deepcopy(sample)) == task.ref(*sample), (source, sample)
        doc = namespace[name].__doc__
        test = doctest.DocTestParser().get_doctest(doc, namespace, name, None, 0)
        assert len(test.examples) == 2
        assert doctest.DocTestRunner().run(test, out=lambda _: None).failed == 0, source


def test_synthetic_conversations_tokenize_as_inference_sees_them():
    """The synthetic exchanges go through the same prefix-stable chat encoding as the
    corpus's, and the README's chat request is one of them, word for word."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    conversations = tiny_synth.conversations(per_task=4)
    assert len(conversations) == 4 * len(tiny_synth.TASKS)
    encoded = train_tiny.encode_conversations(tokenizer, conversations)  # raises if not
    assert all(ids[-1] != tokenizer.eos_token_id for ids in encoded)
    requests = {c[0]["content"] for c in tiny_synth.conversations(per_task=100)}
    assert install_tiny.README_CHAT_PROMPT in requests


def test_heldout_code_cannot_reach_training():
    assert not set(tiny_corpus.HELDOUT_PACKAGES) & set(tiny_corpus.TRAIN_PACKAGES)
    heldout = SOURCE + "\n".join(f"value_{i} = compute_something_long({i})" for i in range(40))
    copy = "# vendored\n" + heldout
    unrelated = "\n".join(f"other_name_{i} = a_different_function({i})" for i in range(40))
    train = {"copy.py": copy, "unrelated.py": unrelated, "unrelated_again.py": unrelated}
    kept, dropped = tiny_corpus.leakage_filter(train, [heldout])
    assert set(kept) == {"unrelated.py"}
    assert dropped["copy.py"] > 8 and dropped["unrelated_again.py"] == -1


def write_data_dir(path: Path, tokenizer) -> None:
    """A data folder as ``prepare`` writes it, from a few stdlib-like documents."""
    text = SOURCE * 30
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(text, add_special_tokens=False)
    tiny_trainer.write_train_tokens(path / tiny_trainer.TRAIN_TOKENS_FILE, np.array([eos, *ids]))
    tokenizer.save_pretrained(path / "tokenizer")
    (path / "heldout.json").write_text(json.dumps({"a.py": SOURCE * 3}))
    (path / "heldout_third_party.json").write_text(json.dumps({"b.py": SOURCE * 2}))
    prompt = [{"role": "user", "content": "Write a Python function `add(a, b=1)`."}]
    records = [{"source": "a.py:add", "messages": prompt}]
    (path / "chat_heldout.json").write_text(json.dumps(records))
    meta = {"python": "3.x", "sources": {}, "num_train_tokens": len(ids) + 1}
    (path / "meta.json").write_text(json.dumps(meta))


def cpu_run(tmp_path: Path, **options) -> tiny_trainer.TrainOptions:
    """A data folder in tmp_path (write_data_dir) and the options of a small Bamba run on
    it on the CPU, writing to tmp_path / "out"; `options` adds the run's own."""
    from transformers import AutoTokenizer

    write_data_dir(tmp_path, AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER))
    return tiny_trainer.TrainOptions(
        data_dir=tmp_path,
        out_dir=tmp_path / "out",
        family="bamba",
        seq_len=64,
        batch_size=2,
        device="cpu",
        weights_only=True,
        chat_eval_prompts=1,
        **options,
    )


def test_time_bounded_training_run_saves_and_evaluates(tmp_path):
    from transformers import AutoModelForCausalLM

    options = cpu_run(
        tmp_path,
        minutes=0.05,
        warmup_steps=2,
        log_every_seconds=1.0,
        save_every_minutes=0.02,
        chat_max_new_tokens=8,
    )
    report = tiny_trainer.train(options)
    out = tmp_path / "out" / "ssmserve-bamba-tiny"
    assert report["status"] == "done" and report["steps"] > 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "training_report.json",
    ]
    # Checkpoints were written while training, each with the held-out progress figures.
    assert any("heldout_loss" in entry for entry in report["log"])
    saved = json.loads((out / "training_report.json").read_text())
    assert saved["status"] == "done" and saved["steps"] == report["steps"]
    figures = saved["heldout"]
    assert 0 < figures["heldout"]["bits_per_byte"] < 20
    assert 0 < figures["heldout_third_party"]["bits_per_byte"] < 20
    assert figures["chat"]["num_prompts"] == 1 and figures["chat"]["max_new_tokens"] == 8
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.config.attn_layer_indices == [2, 5, 8]


def test_training_continues_from_a_checkpoint_of_the_same_model(tmp_path):
    """--init-from: a run of zero steps from the bundled Bamba saves its weights bit for
    bit (the run started from them, not from a fresh initialisation); a checkpoint of
    another shape is refused by name."""
    from safetensors.torch import load_file

    bundled = Path(ssmserve.__file__).parent / "model_data"
    options = cpu_run(
        tmp_path,
        minutes=1.0,
        max_steps=0,
        chat_max_new_tokens=4,
        init_from=bundled / "ssmserve-bamba-tiny",
    )
    report = tiny_trainer.train(options)
    assert report["status"] == "done" and report["steps"] == 0
    assert report["init_from"] == str(bundled / "ssmserve-bamba-tiny")
    saved = load_file(tmp_path / "out" / "ssmserve-bamba-tiny" / "model.safetensors")
    original = load_file(bundled / "ssmserve-bamba-tiny" / "model.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)

    options.init_from = bundled / "ssmserve-mamba2-tiny"
    with pytest.raises(ValueError, match="not a bamba of build_model's shape"):
        tiny_trainer.train(options)
