"""A stand-in LLMEngine with the real contract, for developing the server before the engine lands.

Tokens come from a hash of the sequence so far (deterministic, seedable); blocks and slots are
counted like the real caches so the server's bookkeeping can be checked.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass

from ssmserve.outputs import CompletionOutput, Logprob, RequestOutput


class InvalidRequestError(ValueError):
    pass


@dataclass
class _ModelConfig:
    max_model_len: int


class _Seq:
    def __init__(self, request_id, prompt, prompt_ids, params, index):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.cum = 0.0
        self.finish_reason = None
        self.rng = random.Random(params.seed * 1000 + index if params.seed is not None else None)


class FakeEngine:
    def __init__(self, tokenizer, max_model_len=256, max_num_seqs=8, block_size=4, step_s=0.0):
        self.tokenizer = tokenizer
        self.model_config = _ModelConfig(max_model_len)
        self.model_name = "fake"
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.step_s = step_s
        self.vocab = len(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.requests: dict[str, list[_Seq]] = {}
        self.order: list[str] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add_request(self, request_id, prompt, params):
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), None
        else:
            text = prompt["prompt"] if isinstance(prompt, dict) else prompt
            ids = self.tokenizer(text).input_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if any(not 0 <= t < self.vocab for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab})")
        if len(ids) >= self.model_config.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max_model_len is "
                f"{self.model_config.max_model_len}; raise --max-model-len or shorten the prompt"
            )
        self.requests[request_id] = [
            _Seq(request_id, text, ids, params, i) for i in range(params.n)
        ]
        self.order.append(request_id)
        self.prompt_tokens_total += len(ids)

    def abort_request(self, request_id):
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            self.requests.pop(rid, None)
            if rid in self.order:
                self.order.remove(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def _running(self):
        return self.order[: self.max_num_seqs]

    def stats(self):
        running = self._running()
        blocks = sum(
            math.ceil((len(s.prompt_ids) + len(s.token_ids) + 1) / self.block_size)
            for rid in running
            for s in self.requests[rid]
        )
        slots = sum(len(self.requests[rid]) for rid in running)
        return dict(
            kv_blocks_used=blocks,
            kv_blocks_total=1000,
            state_slots_used=slots,
            state_slots_total=self.max_num_seqs,
            num_running=len(running),
            num_waiting=len(self.order) - len(running),
            num_preemptions=0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def _next(self, seq):
        h = hashlib.sha256(str(seq.prompt_ids + seq.token_ids).encode()).digest()
        scores = [((h[i % 32] * 31 + i * 17) % 101) / 10.0 for i in range(self.vocab)]
        scores[self.eos] = -5.0
        m = max(scores)
        z = math.log(sum(math.exp(s - m) for s in scores)) + m
        lps = [s - z for s in scores]
        if seq.params.temperature == 0:
            tok = max(range(self.vocab), key=lambda i: lps[i])
        else:
            tok = seq.rng.choices(range(self.vocab), weights=[math.exp(x) for x in lps])[0]
        entry = None
        if seq.params.logprobs is not None:
            ranked = sorted(range(self.vocab), key=lambda i: -lps[i])
            keep = set(ranked[: seq.params.logprobs]) | {tok}
            entry = {
                t: Logprob(lps[t], ranked.index(t) + 1, self.tokenizer.decode([t])) for t in keep
            }
        return tok, lps[tok], entry

    def step(self):
        if self.step_s:
            time.sleep(self.step_s)
        outs = []
        for rid in list(self._running()):
            seqs = self.requests[rid]
            for seq in seqs:
                if seq.finish_reason:
                    continue
                tok, lp, entry = self._next(seq)
                seq.token_ids.append(tok)
                seq.cum += lp
                if entry is not None:
                    seq.logprobs.append(entry)
                self.generation_tokens_total += 1
                text = self.tokenizer.decode(seq.token_ids)
                if any(s in text for s in seq.params.stop):
                    seq.finish_reason = "stop"
                elif (
                    len(seq.token_ids) >= (seq.params.max_tokens or 10**9)
                    or len(seq.prompt_ids) + len(seq.token_ids) >= self.model_config.max_model_len
                ):
                    seq.finish_reason = "length"
            finished = all(s.finish_reason for s in seqs)
            prompt_lps = None
            if seqs[0].params.prompt_logprobs is not None:
                dec = self.tokenizer.decode
                prompt_lps = [None] + [
                    {t: Logprob(-1.0, 1, dec([t]))} for t in seqs[0].prompt_ids[1:]
                ]
            outs.append(
                RequestOutput(
                    request_id=rid,
                    prompt=seqs[0].prompt,
                    prompt_token_ids=seqs[0].prompt_ids,
                    prompt_logprobs=prompt_lps,
                    outputs=[
                        CompletionOutput(
                            s.index,
                            self.tokenizer.decode(s.token_ids),
                            list(s.token_ids),
                            s.cum,
                            list(s.logprobs) if s.params.logprobs is not None else None,
                            s.finish_reason,
                        )
                        for s in seqs
                    ],
                    finished=finished,
                )
            )
            if finished:
                self.abort_request(rid)
        return outs
