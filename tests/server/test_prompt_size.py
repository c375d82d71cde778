"""#18.2: prompts are tokenized once, off the event loop; a prompt whose size alone proves
it too long is refused without tokenizing; /health answers meanwhile."""

from __future__ import annotations

import gc
import json
import os
import shutil
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ssmserve.server.app import build_app
from ssmserve.server.async_engine import AsyncLLMEngine
from ssmserve.server.tokens import PromptTokenizer, WorkerPool, max_bytes_per_token
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, ServerThread, make_engine

HEALTH_BUDGET_S = 0.1


class HealthProbe:
    """Polls /health from a thread on one connection; records each answer's latency.

    The test process holds every fixture of the session; a full garbage collection over
    that heap pauses all its threads, client and server alike, for longer than the budget.
    The heap is frozen while probing, so the pauses measured are the server's own.
    """

    def __init__(self, base_url: str) -> None:
        self.url = base_url + "/health"
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                assert http.get(self.url).status_code == 200
                self.latencies.append(time.monotonic() - start)
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        gc.collect()
        gc.freeze()
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        gc.unfreeze()


def _post_bytes(url: str, body: dict) -> httpx.Response:
    content = json.dumps(body).encode()  # encoded up front: the probe measures the server
    return httpx.post(
        url, content=content, headers={"content-type": "application/json"}, timeout=120
    )


def test_huge_prompt_is_refused_by_size_while_health_answers(server, engine, monkeypatch):
    per_token = max_bytes_per_token(engine.tokenizer)
    assert per_token is not None  # a byte-level BPE: the size bound applies
    tokens = server.app.state.serving.tokens
    encoded: list[int] = []
    real_encode = tokens.encode
    monkeypatch.setattr(
        tokens, "encode", lambda text, *a: encoded.append(len(text)) or real_encode(text, *a)
    )
    prompt = "x = 1\n" * (2 * 2**20 // 6)  # 2 MiB: 200 times what fits, seconds to tokenize
    with HealthProbe(server.base_url) as probe:
        r = _post_bytes(
            server.base_url + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt}
        )
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}]}
        r_chat = _post_bytes(server.base_url + "/v1/chat/completions", chat)
    for response in (r, r_chat):
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"{per_token} bytes in a token" in message and str(MAX_MODEL_LEN) in message
    assert encoded == []  # refused by size: never tokenized
    assert len(probe.latencies) > 3
    assert max(probe.latencies) < HEALTH_BUDGET_S, sorted(probe.latencies)[-5:]


@pytest.fixture(scope="module")
def unbounded_checkpoint(bamba_checkpoint, tmp_path_factory) -> str:
    """The tiny Bamba behind an NFC normalizer (same tokens for ASCII text), so no size
    bound can be proven and every prompt is tokenized."""
    path = str(tmp_path_factory.mktemp("nfc") / "bamba-nfc")
    shutil.copytree(bamba_checkpoint, path)
    spec_file = os.path.join(path, "tokenizer.json")
    with open(spec_file) as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "NFC"}
    with open(spec_file, "w") as f:
        json.dump(spec, f)
    return path


@pytest.fixture(scope="module")
def unbounded_server(unbounded_checkpoint):
    engine = make_engine(unbounded_checkpoint)
    added: list = []
    real_add = engine.add_request

    def add_request(request_id, prompt, params):
        added.append(prompt)
        return real_add(request_id, prompt, params)

    engine.add_request = add_request
    with ServerThread(build_app(AsyncLLMEngine(engine), MODEL_NAME)) as srv:
        srv.added = added
        yield srv


def test_long_prompt_is_tokenized_off_the_event_loop(unbounded_server, monkeypatch):
    srv = unbounded_server
    assert max_bytes_per_token(srv.app.state.serving.tokenizer) is None
    tokens = srv.app.state.serving.tokens
    started, release = threading.Event(), threading.Event()
    real_encode = tokens.encode

    def encode(text, *args):
        started.set()
        release.wait(30)  # the tokenizer is busy until the test has seen /health answer
        return real_encode(text, *args)

    monkeypatch.setattr(tokens, "encode", encode)
    prompt = "def f(x): return x + 1\n" * (2**20 // 23)  # 1 MiB
    result: dict = {}
    body = {"model": MODEL_NAME, "prompt": prompt}
    post = threading.Thread(
        target=lambda: result.update(r=_post_bytes(srv.base_url + "/v1/completions", body))
    )
    post.start()
    try:
        assert started.wait(30)
        # On the event loop, the held tokenizer would hold /health too: it answers at once.
        start = time.monotonic()
        health = httpx.get(srv.base_url + "/health", timeout=10)
        answered = time.monotonic() - start
    finally:
        release.set()
        post.join(60)
    assert health.status_code == 200 and answered < 1.0, answered
    r = result["r"]
    assert r.status_code == 400, r.text
    assert f"max_model_len is {MAX_MODEL_LEN}" in r.json()["error"]["message"]
    assert srv.added == []  # refused after tokenizing, before the engine


def test_the_engine_gets_token_ids_not_text(unbounded_server, engine):
    srv = unbounded_server
    srv.added.clear()
    body = {"model": MODEL_NAME, "prompt": "def fib(n):", "max_tokens": 2}
    assert httpx.post(srv.base_url + "/v1/completions", json=body).status_code == 200
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(srv.base_url + "/v1/chat/completions", json=chat).status_code == 200
    completion, conversation = srv.added
    assert completion == {
        "prompt": "def fib(n):",
        "prompt_token_ids": engine.tokenizer("def fib(n):").input_ids,
    }
    assert set(conversation) == {"prompt", "prompt_token_ids"}


# ----------------------------------------------------------------------------- the bound


TEXTS = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=300
) | st.sampled_from(["", " " * 300, "\n" * 100 + "    " * 50, "<|endoftext|>" * 20, "é漢字🙂" * 30])


@pytest.fixture(scope="module")
def tiny_tokenizer(engine):
    return engine.tokenizer


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_byte_level_bound_holds_and_encode_matches_the_tokenizer(tiny_tokenizer, text):
    per_token = max_bytes_per_token(tiny_tokenizer)
    prompts = PromptTokenizer(tiny_tokenizer, pool=None, max_model_len=MAX_MODEL_LEN)
    for special in (True, False):
        ids = prompts.encode(text, add_special_tokens=special)
        assert ids == tiny_tokenizer(text, add_special_tokens=special).input_ids
    assert len(text.encode()) <= per_token * len(prompts.encode(text, add_special_tokens=False))


def test_byte_level_bound_is_the_longest_token(tiny_tokenizer):
    per_token = max_bytes_per_token(tiny_tokenizer)
    vocab = tiny_tokenizer.get_vocab()
    longest = max(vocab, key=lambda t: len(t) if t not in tiny_tokenizer.all_special_tokens else 0)
    text = tiny_tokenizer.convert_tokens_to_string([longest])
    # A text made of that token alone: one token per `len(longest)` bytes.
    assert len(tiny_tokenizer(text * 10, add_special_tokens=False).input_ids) == 10
    assert per_token >= len(text.encode()) == len(longest)


def _fast(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_byte_fallback_bound_holds():
    # Llama-2 style: spaces become "▁", unknown characters fall back to byte tokens.
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "a", "b", "▁a", "ab", "▁ab", "▁abab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("▁", "ab"), ("▁ab", "ab")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer = _fast(backend)
    per_token = max_bytes_per_token(tokenizer)
    assert per_token == len("▁abab".encode())
    for text in ["ab ab ab", " " * 50, "é漢字🙂 zz", "abab" * 40]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(text.encode()) <= per_token * len(ids)


def test_no_bound_where_the_pipeline_can_shrink_text(tiny_tokenizer):
    spec = json.loads(tiny_tokenizer.backend_tokenizer.to_str())

    def variant(**changes) -> PreTrainedTokenizerFast:
        return _fast(Tokenizer.from_str(json.dumps({**spec, **changes})))

    assert max_bytes_per_token(variant()) is not None
    assert max_bytes_per_token(variant(normalizer={"type": "NFKC"})) is None
    assert (
        max_bytes_per_token(
            variant(normalizer={"type": "Strip", "strip_left": True, "strip_right": True})
        )
        is None
    )
    assert max_bytes_per_token(variant(pre_tokenizer={"type": "WhitespaceSplit"})) is None
    lstrip = [dict(t, lstrip=True) if i == 0 else t for i, t in enumerate(spec["added_tokens"])]
    assert max_bytes_per_token(variant(added_tokens=lstrip)) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_bytes_per_token(_fast(wordpiece)) is None


def test_worker_pool_runs_off_the_caller_and_passes_errors_back():
    import asyncio

    pool = WorkerPool(2, "test-pool")

    async def main():
        caller = threading.get_ident()
        ident = await pool.run(threading.get_ident)
        with pytest.raises(ZeroDivisionError):
            await pool.run(lambda: 1 / 0)
        return caller, ident

    caller, ident = asyncio.run(main())
    pool.close()
    assert caller != ident
