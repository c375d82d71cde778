"""What every generation endpoint shares: the serving context (engine, tokenizer, names,
metrics), sampling parameters from a request, adding requests, collecting their outputs,
and watching for clients that leave."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request

from ssmserve.outputs import RequestOutput
from ssmserve.sampling_params import SamplingParams, with_defaults
from ssmserve.server.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestAbortedError,
    RequestStream,
)
from ssmserve.server.errors import APIError, bad_request, server_error
from ssmserve.server.metrics import ServerMetrics
from ssmserve.server.options import ServerOptions
from ssmserve.server.protocol import SamplingFields, UsageInfo
from ssmserve.server.tokens import PromptTokenizer, WorkerPool

_SAMPLING_PARAM_NAMES = {
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
}
_OPTIONAL_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class ServingContext:
    """The engine, the server's options, and what the endpoints know about the served
    model. `close()` stops its tokenizer threads."""

    def __init__(
        self,
        async_engine: AsyncLLMEngine,
        served_model_name: str | Sequence[str] | None = None,
        options: ServerOptions | None = None,
    ) -> None:
        if served_model_name is None:
            names = [async_engine.model_name]
        elif isinstance(served_model_name, str):
            names = [served_model_name]
        else:
            names = list(served_model_name) or [async_engine.model_name]
        self.async_engine = async_engine
        self.tokenizer = async_engine.tokenizer
        self.sampling_defaults: dict[str, Any] = async_engine.sampling_defaults
        self.names = names
        self.model_name = names[0]  # the name reported in responses
        self.metrics = ServerMetrics(async_engine.stats)
        self.options = options or ServerOptions()
        self.pool = WorkerPool(self.options.tokenizer_pool_size, "ssmserve-tokenizer")
        self.tokens = PromptTokenizer(self.tokenizer, self.pool, async_engine.max_model_len)

    def close(self) -> None:
        self.pool.close()

    @property
    def max_model_len(self) -> int:
        return self.async_engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(
                404,
                f"the model `{name}` does not exist; this server serves "
                + ", ".join(f"`{n}`" for n in self.names),
                param="model",
                code="model_not_found",
            )

    def check_limits(self, req: SamplingFields, num_prompts: int = 1) -> None:
        """400 naming the limit when a request asks for more than the server allows."""
        opts = self.options
        if req.n > opts.max_n:
            raise bad_request(
                f"n is {req.n}, but this server allows at most {opts.max_n} samples per "
                "request (--max-n)",
                "n",
            )
        if num_prompts > opts.max_prompts_per_request:
            raise bad_request(
                f"the request has {num_prompts} prompts, but this server allows at most "
                f"{opts.max_prompts_per_request} per request (--max-prompts-per-request)",
                "prompt",
            )
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > opts.max_stop_strings:
            raise bad_request(
                f"the request has {len(stops)} stop strings, but this server allows at most "
                f"{opts.max_stop_strings} (--max-stop-strings)",
                "stop",
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > opts.max_stop_string_length:
            raise bad_request(
                f"a stop string is {longest} characters long, but this server allows at most "
                f"{opts.max_stop_string_length} (--max-stop-string-length)",
                "stop",
            )

    def check_context_length(self, prompts: list[dict[str, Any]], max_tokens: int) -> None:
        """As OpenAI and vLLM do: 400 when prompt + max_tokens exceeds the context.
        (Prompts longer than the context on their own get the engine's message.)"""
        limit = self.max_model_len
        for prompt in prompts:
            n = len(prompt["prompt_token_ids"])
            if n < limit < n + max_tokens:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in "
                    "the completion). Please reduce the length of the prompt or completion.",
                    "max_tokens",
                )

    async def add_requests(
        self, request_id: str, prompts: list[dict[str, Any]], params: SamplingParams
    ) -> list[RequestStream]:
        """Add one engine request per tokenized prompt (`{"prompt_token_ids": [...]}`, with
        its "prompt" text if it has one); on any failure none of them stays."""
        if params.max_tokens is not None:
            self.check_context_length(prompts, params.max_tokens)
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.async_engine.add_request(sub_id, prompt, params))
        except BaseException as exc:
            abort_all(streams)
            if isinstance(exc, ValueError):
                raise bad_request(str(exc), "prompt") from exc
            if isinstance(exc, Exception) and not isinstance(
                exc, (EngineDeadError, RequestAbortedError, APIError)
            ):
                message = f"could not add the request: {type(exc).__name__}: {exc}"
                raise server_error(message) from exc
            raise
        return streams

    async def collect_final(
        self, raw: Request | None, streams: list[RequestStream], timing: Timing
    ) -> list[RequestOutput] | None:
        """Each stream's last output, or None if the client went away first.

        `raw` is the HTTP request whose disconnect aborts the work; None watches nothing.
        """

        async def collect() -> list[RequestOutput]:
            finals: list[Any] = [None] * len(streams)
            async for index, output in merged_outputs(streams, timing):
                finals[index] = output
            return finals

        try:
            if raw is None:
                return await collect()
            return await _unless_disconnected(raw, collect())
        except _ClientGone:
            return None
        finally:
            abort_all(streams)


def sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's SamplingParams of a request; a 400 naming the field when one is bad.
    Optional fields the request leaves unset take `defaults` (the model's
    generation_config.json, `--generation-config`), else the built-in defaults."""
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    kwargs: dict[str, Any] = dict(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    optional = {k: getattr(req, k) for k in _OPTIONAL_SAMPLING_FIELDS}
    kwargs.update(with_defaults(optional, defaults))
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        first_word = str(exc).split(" ", 1)[0]
        param = first_word if first_word in _SAMPLING_PARAM_NAMES else None
        raise bad_request(str(exc), param) from exc


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


class Timing:
    """Feeds time-to-first-token, inter-token latency and finish reasons of one HTTP request."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: dict[int, float] = {}
        self.tokens: dict[tuple[int, int], int] = {}

    def observe(self, stream_index: int, output: RequestOutput) -> None:
        now = time.monotonic()
        if output.finished:
            for out in output.outputs:
                self.metrics.requests_finished.labels(out.finish_reason or "abort").inc()
        new = 0
        for out in output.outputs:
            key = (stream_index, out.index)
            new = max(new, len(out.token_ids) - self.tokens.get(key, 0))
            self.tokens[key] = len(out.token_ids)
        if new == 0:
            return
        last = self.last.get(stream_index)
        if last is None:
            self.metrics.time_to_first_token.observe(now - self.start)
            new -= 1
        else:
            for _ in range(new):
                self.metrics.inter_token_latency.observe((now - last) / new)
        self.last[stream_index] = now


async def merged_outputs(
    streams: list[RequestStream], timing: Timing
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order, and
    feed each output to `timing`."""
    async for index, output in _merge(streams):
        timing.observe(index, output)
        yield index, output


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                merged.put_nowait((index, output))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            merged.put_nowait((index, exc))
        finally:
            merged.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class _ClientGone(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    # NOTE: only valid once the body has been read; later receives report the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, cancelling it (and raising _ClientGone) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise _ClientGone
