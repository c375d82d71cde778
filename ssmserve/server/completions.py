"""POST /v1/completions: text or token-id prompts, echo, legacy logprobs, streaming."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from ssmserve.outputs import CompletionOutput, RequestOutput
from ssmserve.server.errors import bad_request
from ssmserve.server.logprobs import legacy_logprobs
from ssmserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from ssmserve.server.serving import ServingContext, Timing, sampling_params, usage
from ssmserve.server.streaming import (
    ChoiceUpdate,
    StreamState,
    event_stream_response,
    sse,
    sse_events,
)


class Completions:
    """The completions endpoint over one serving context."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw: Request | None) -> Any:
        """A CompletionResponse, an SSE response when `req.stream`, or 499 if the client of
        `raw` left before the end (None: nobody to watch)."""
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (it must equal n)", "best_of")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request(
                "max_tokens must be at least 1 (0 is allowed with echo=true, to return the "
                "prompt and its logprobs without generating)",
                "max_tokens",
            )
        prompts = completion_prompts(req.prompt)
        ctx.check_limits(req, len(prompts))
        echo_only = req.max_tokens == 0
        echo_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = sampling_params(
            req,
            # Scoring a prompt runs one step; the token it samples is not returned.
            max_tokens=1 if echo_only else req.max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=echo_logprobs,
            defaults=ctx.sampling_defaults,
        )
        engine_prompts = await asyncio.gather(*(self._engine_prompt(p) for p in prompts))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        timing = Timing(ctx.metrics)
        streams = await ctx.add_requests(request_id, list(engine_prompts), params)
        reply = _Reply(ctx, req, prompts, request_id, int(time.time()), echo_only)
        if req.stream:
            state = StreamState(len(streams), req.n)
            events = sse_events(
                streams,
                timing,
                state,
                reply.chunk,
                usage_chunk=reply.usage_chunk if reply.include_usage else None,
                send_first=reply.echo_ready if req.echo else None,
            )
            return event_stream_response(request_id, events, streams)
        finals = await ctx.collect_final(raw, streams, timing)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        return reply.full(finals)

    async def _engine_prompt(self, prompt: str | list[int]) -> dict[str, Any]:
        if isinstance(prompt, str):
            ids = await self.ctx.tokens.tokenize_prompt(prompt, "prompt")
            return {"prompt": prompt, "prompt_token_ids": ids}
        self.ctx.tokens.check_length(prompt, "prompt")
        return {"prompt_token_ids": prompt}


class _Reply:
    """Builds the response objects of one completion request."""

    def __init__(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        prompts: list[str | list[int]],
        request_id: str,
        created: int,
        echo_only: bool,
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.echo_only = echo_only  # max_tokens=0: the prompt, none of the sampled token
        self.prompts = prompts
        self.request_id = request_id
        self.created = created
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.offsets: dict[int, int] = {}  # next text_offset per streamed choice

    def _prompt_text(self, index: int, output: RequestOutput) -> str:
        prompt = self.prompts[index]
        if isinstance(prompt, str):
            return prompt
        if output.prompt is not None:
            return output.prompt
        return self.ctx.tokenizer.decode(output.prompt_token_ids)

    def _payload(
        self,
        index: int,
        output: RequestOutput,
        out: CompletionOutput,
        start_char: int,
        start_token: int,
        offset: int,
        first: bool,
    ) -> tuple[str, CompletionLogprobs | None, int]:
        """Text and logprobs of `out` from the given positions, and the next text_offset.

        The `first` payload of a choice carries the echoed prompt."""
        req, tokenizer = self.req, self.ctx.tokenizer
        if self.echo_only:
            start_char, start_token = len(out.text), len(out.token_ids)
        text = out.text[start_char:]
        if req.echo and first:
            text = self._prompt_text(index, output) + text
        if req.logprobs is None:
            return text, None, offset
        logprobs = CompletionLogprobs()
        if req.echo and first and output.prompt_logprobs is not None:
            offset = legacy_logprobs(
                output.prompt_token_ids,
                output.prompt_logprobs,
                req.logprobs,
                tokenizer,
                offset,
                logprobs,
            )
        offset = legacy_logprobs(
            out.token_ids[start_token:],
            (out.logprobs or [])[start_token:],
            req.logprobs,
            tokenizer,
            offset,
            logprobs,
        )
        return text, logprobs, offset

    def echo_ready(self, output: RequestOutput) -> bool:
        """With echo, the prompt goes out first, once its logprobs (if asked for) are
        complete."""
        return self.req.logprobs is None or output.prompt_logprobs is not None

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> Any:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage,
        )

    def chunk(self, update: ChoiceUpdate) -> str:
        index = update.choice // self.req.n
        text, logprobs, self.offsets[update.choice] = self._payload(
            index,
            update.output,
            update.completion,
            update.start_char,
            update.start_token,
            self.offsets.get(update.choice, 0),
            first=update.first,
        )
        choice = self._choice(update.choice, text, logprobs, update.completion)
        return sse(self._response([choice], None), None if self.include_usage else {"usage"})

    def _choice(
        self, index: int, text: str, logprobs: CompletionLogprobs | None, out: CompletionOutput
    ) -> CompletionChoice:
        if self.echo_only and out.finish_reason is not None:
            finish_reason, stop_reason = "length", None  # max_tokens=0 reached
        else:
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

    def usage_chunk(self, totals: UsageInfo) -> str:
        if self.echo_only:
            totals = usage(totals.prompt_tokens, 0)
        return sse(self._response([], totals))

    def full(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, output in enumerate(finals):
            prompt_tokens += len(output.prompt_token_ids)
            for out in output.outputs:
                if not self.echo_only:
                    completion_tokens += len(out.token_ids)
                text, logprobs, _ = self._payload(index, output, out, 0, 0, 0, first=True)
                choices.append(self._choice(index * self.req.n + out.index, text, logprobs, out))
        return self._response(choices, usage(prompt_tokens, completion_tokens))


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The request's prompts: one text, several texts, one token list or several."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return list(prompt)
    if any(len(p) == 0 for p in prompt):
        raise bad_request("token-id prompts must not be empty", "prompt")
    return [list(p) for p in prompt]
