"""Turns sampled tokens into RequestOutputs: logprobs, incremental text, stop strings.

The engine calls `record` right after a step's tokens come back (only what decides the
next step happens there: stop strings end requests) and `outputs` afterwards, while the
GPU already runs the next step: text, logprob entries and RequestOutput objects are built
off the critical path. A request that wants only its final output (FINAL_ONLY, as
`LLM.generate` asks) and has no stop strings is detokenized once, when it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ssmserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from ssmserve.engine.sampler import SamplerOutput
from ssmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ssmserve.sampling_params import RequestOutputKind, SamplingParams
from ssmserve.scheduler import Request

# (token, logprob, rank, top ids, top logprobs) of one generated position, before the
# decoded strings of its Logprob entries are made.
RawLogprobs = tuple[int, float, int | None, list[int], list[float]]


@dataclass
class Sample:
    """One of a request's n samples: a scheduler Request plus its output-side state."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    raw_logprobs: list[RawLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_detokenized: int = 0  # output tokens already fed to the detokenizer
    finish_reason: str | None = None
    text_end: int | None = None  # where a stop string cut the text
    sent_tokens: int = 0  # DELTA outputs: what earlier outputs already carried
    sent_text: int = 0


@dataclass
class Group:
    """A user request: prompt, params, and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, Group] = {}
        self.owner: dict[str, tuple[Group, Sample]] = {}
        self.generation_tokens_total = 0

    def add(self, group: Group) -> None:
        self.groups[group.request_id] = group
        for sample in group.samples:
            self.owner[sample.request.request_id] = (group, sample)

    def new_sample(self, index: int, request: Request, params: SamplingParams) -> Sample:
        return Sample(
            index=index,
            request=request,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            logprobs=[] if params.logprobs is not None else None,
        )

    def remove(self, request_id: str) -> Group | None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            for sample in group.samples:
                self.owner.pop(sample.request.request_id, None)
        return group

    # -- right after a step: what the next step depends on --------------------------

    def record(
        self,
        requests: list[Request],
        out: SamplerOutput,
        row_of: dict[str, int],
        finish: Callable[[Request, str], None],
        now: float,
    ) -> None:
        """Note each request's new token; end those whose text now holds a stop string
        (through `finish(request, stop)`)."""
        for request in requests:
            group, sample = self.owner[request.request_id]
            i = row_of[request.request_id]
            self.generation_tokens_total += 1
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
            sample.cumulative_logprob += out.logprobs[i]
            if sample.logprobs is not None:
                sample.raw_logprobs.append(
                    (
                        request.output_token_ids[-1],
                        out.logprobs[i],
                        out.ranks[i],
                        out.top_ids[i],
                        out.top_logprobs[i],
                    )
                )
            stops = group.params.stop
            if stops:
                delta = self._detokenize(sample)
                hit = find_stop(sample.detokenizer.text, len(delta), stops) if delta else None
                if hit is not None:
                    idx, stop = hit
                    keep = group.params.include_stop_str_in_output
                    sample.text_end = idx + len(stop) if keep else idx
                    finish(request, stop)

    # -- off the critical path ------------------------------------------------------

    def outputs(self, group_ids: list[str], now: float) -> list[RequestOutput]:
        """RequestOutputs of the touched groups (as each one's output_kind asks); finished
        groups are released."""
        results = []
        for rid in group_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            for sample in group.samples:
                if sample.finish_reason is None and sample.request.is_finished:
                    sample.finish_reason = sample.request.status.value
            finished = group.finished
            if finished and group.metrics.finished_time is None:
                group.metrics.finished_time = now
            kind = group.params.output_kind
            if kind != RequestOutputKind.FINAL_ONLY or finished:
                results.append(self._output(group, kind))
            if finished:
                self.remove(rid)
        return results

    def _detokenize(self, sample: Sample) -> str:
        """Feed the detokenizer the tokens it has not seen; return the new text."""
        ids = sample.request.output_token_ids
        pieces = [sample.detokenizer.add(t) for t in ids[sample.num_detokenized :]]
        sample.num_detokenized = len(ids)
        return "".join(pieces)

    def _logprob_entries(self, sample: Sample) -> list[dict[int, Logprob]]:
        for token, lp, rank, top_ids, top_lps in sample.raw_logprobs:
            sample.logprobs.append(self.logprob_entry(token, lp, rank, top_ids, top_lps))
        sample.raw_logprobs.clear()
        return sample.logprobs

    def logprob_entry(
        self,
        token_id: int,
        logprob: float,
        rank: int | None,
        top_ids: list[int],
        top_logprobs: list[float],
    ) -> dict[int, Logprob]:
        """One position's logprobs: the actual token, then the top alternatives by rank."""
        decode = self.tokenizer.decode
        entry = {token_id: Logprob(logprob, rank, decode([token_id]))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), 1):
            entry.setdefault(tid, Logprob(lp, r, decode([tid])))
        return entry

    def _visible_text(self, group: Group, sample: Sample) -> str:
        self._detokenize(sample)
        text = sample.detokenizer.text
        if sample.text_end is not None:
            return text[: sample.text_end]
        if sample.finish_reason is None and group.params.stop:
            # Hold back what could still turn out to be the start of a stop string.
            hold = max(len(s) for s in group.params.stop) - 1
            return text[: len(text) - hold] if hold else text
        return text

    def _output(self, group: Group, kind: RequestOutputKind) -> RequestOutput:
        delta = kind == RequestOutputKind.DELTA
        outputs = []
        for s in group.samples:
            text = self._visible_text(group, s)
            ids = s.request.output_token_ids
            logprobs = self._logprob_entries(s) if s.logprobs is not None else None
            if delta:
                text, ids = text[s.sent_text :], ids[s.sent_tokens :]
                logprobs = logprobs[s.sent_tokens :] if logprobs is not None else None
                s.sent_text += len(text)
                s.sent_tokens += len(ids)
            outputs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(ids),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.request.stop_reason,
                )
            )
        prompt_done = group.prompt_logprobs is None or len(group.prompt_logprobs) >= len(
            group.prompt_token_ids
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs if prompt_done else None,
            outputs=outputs,
            finished=group.finished,
            metrics=group.metrics,
            num_cached_tokens=group.samples[0].request.num_cached_tokens,
        )
