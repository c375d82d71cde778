"""LLM: the offline, vLLM-shaped Python API over LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from ssmserve.config import EngineConfig
from ssmserve.engine.collector import freeze_startup_objects
from ssmserve.engine.engine import LLMEngine, PromptType
from ssmserve.outputs import RequestOutput
from ssmserve.sampling_params import RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Generate from a checkpoint in-process.

    >>> llm = LLM()  # the small model bundled with ssmserve
    >>> out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=32, temperature=0))
    >>> print(out[0].outputs[0].text)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> LLM:
        freeze_startup_objects()  # as LLMEngine does, before this object exists
        return super().__new__(cls)

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict[str, int]:
        """The engine's cache use and counters (LLMEngine.stats)."""
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no request is using; True if nothing is left."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` and `chat` use when given none: the built-in
        defaults, with those the checkpoint's generation_config.json sets (temperature,
        top_p, top_k, min_p, repetition_penalty) unless `generation_config="vllm"`."""
        return self.llm_engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. A progress
        bar (tqdm, on stderr) counts finished prompts unless `use_tqdm=False`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        return self._run(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template."""
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template; pass chat_template=... or use "
                "generate() with a plain prompt"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [str(next(self._ids)) for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                # Only the final output is read: no per-step outputs to build.
                final = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(rid, prompt, final)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # one bad prompt must not leave the others queued
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="prompt", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        rate = out_tokens / max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                        bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]
