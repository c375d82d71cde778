"""POST /v1/chat/completions: messages through the model's chat template, logprobs,
streaming."""

from __future__ import annotations

import functools
import inspect
import time
import uuid
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from ssmserve.outputs import CompletionOutput, RequestOutput
from ssmserve.server.deadline import DeadlineExceeded, call_with_deadline
from ssmserve.server.errors import bad_request
from ssmserve.server.logprobs import chat_logprobs
from ssmserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
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


class Chat:
    """The chat completions endpoint over one serving context."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        # Names apply_chat_template takes for itself; as template variables they would
        # change how it runs (tokenize=True, return_dict=True, ...).
        signature = inspect.signature(ctx.tokenizer.apply_chat_template)
        self._reserved = {
            name
            for name, p in signature.parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        }

    async def render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool = False,
        template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        for_generation: bool = True,
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation, through the model's chat
        template or `template` (a request's, already allowed), on the worker pool.

        `for_generation`: 400 without tokenizing when the text's size proves it cannot fit
        the context (not for /tokenize, which counts tokens of any text)."""
        render = functools.partial(
            self._render,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template=template,
            template_kwargs=template_kwargs or {},
            for_generation=for_generation,
        )
        return await self.ctx.pool.run(render)

    def _render(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template: str | None,
        template_kwargs: dict[str, Any],
        for_generation: bool,
    ) -> tuple[str, list[int]]:
        tokenizer = self.ctx.tokenizer
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                f"the model `{self.ctx.model_name}` has no chat template, so "
                "/v1/chat/completions cannot turn messages into a prompt; use "
                "/v1/completions with a plain prompt",
                "messages",
            )
        conversation = [_flatten_content(m) for m in messages]
        apply = functools.partial(
            tokenizer.apply_chat_template,
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
        limit = self.ctx.options.chat_template_timeout
        try:
            # The model's own template is trusted; a request's runs against the clock.
            text = apply() if template is None else call_with_deadline(limit, apply)
        except DeadlineExceeded:
            raise bad_request(
                f"the request's chat template ran longer than {limit:g} s "
                "(--chat-template-timeout); send a simpler template",
                "chat_template",
            ) from None
        except Exception as exc:  # noqa: BLE001 - template errors describe bad messages
            message = f"the chat template rejected the messages: {exc}"
            raise bad_request(message, "messages") from exc
        if for_generation:
            self.ctx.tokens.check_size(text, "messages")
        # The template already holds any BOS the model wants.
        return text, self.ctx.tokens.encode(text, add_special_tokens=False)

    def _template_of(self, req: ChatCompletionRequest) -> tuple[str | None, dict[str, Any]]:
        """The request's own chat template (None: the model's) and the template variables;
        400 for a request template the server does not trust, or a reserved variable."""
        kwargs = dict(req.chat_template_kwargs or {})
        nested = kwargs.pop("chat_template", None)
        template = req.chat_template if req.chat_template is not None else nested
        if template is not None and not self.ctx.options.trust_request_chat_template:
            raise bad_request(
                "this server does not run chat templates sent in requests (chat_template, "
                "chat_template_kwargs.chat_template); leave them out to use the model's, or "
                "start the server with --trust-request-chat-template",
                "chat_template",
            )
        reserved = sorted(self._reserved & kwargs.keys())
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)}: those are not "
                "template variables",
                "chat_template_kwargs",
            )
        return template, kwargs

    async def create(self, req: ChatCompletionRequest, raw: Request | None) -> Any:
        """A ChatCompletionResponse, an SSE response when `req.stream`, or 499 if the client
        of `raw` left before the end (None: nobody to watch)."""
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.tools:
            raise bad_request("tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request(
                'only response_format {"type": "text"} is supported', "response_format"
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        ctx.check_limits(req)
        template, template_kwargs = self._template_of(req)
        prompt_text, prompt_ids = await self.render(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template=template,
            template_kwargs=template_kwargs,
        )
        ctx.tokens.check_length(prompt_ids, "messages")
        params = sampling_params(
            req,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            defaults=ctx.sampling_defaults,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        timing = Timing(ctx.metrics)
        engine_prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        streams = await ctx.add_requests(request_id, [engine_prompt], params)
        reply = _Reply(ctx, req, request_id, int(time.time()))
        if req.stream:
            opening = [
                reply.chunk_choice(
                    ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                )
                for i in range(req.n)
            ]
            events = sse_events(
                streams,
                timing,
                StreamState(1, req.n),
                reply.chunk,
                opening=opening,
                usage_chunk=reply.usage_chunk if reply.include_usage else None,
            )
            return event_stream_response(request_id, events, streams)
        finals = await ctx.collect_final(raw, streams, timing)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        return reply.full(finals[0])


class _Reply:
    """Builds the response objects of one chat request."""

    def __init__(
        self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str, created: int
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.created = created
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def _logprobs(self, out: CompletionOutput, start: int) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(
            out.token_ids[start:],
            (out.logprobs or [])[start:],
            self.req.top_logprobs or 0,
            self.ctx.tokenizer,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None) -> Any:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage,
        )

    def chunk_choice(self, choice: ChatChunkChoice) -> str:
        return sse(self._chunk([choice], None), None if self.include_usage else {"usage"})

    def chunk(self, update: ChoiceUpdate) -> str:
        return self.chunk_choice(
            ChatChunkChoice(
                index=update.choice,
                delta=DeltaMessage(content=update.new_text or None),  # {} at the finish
                logprobs=self._logprobs(update.completion, update.start_token),
                finish_reason=update.finish_reason,
                stop_reason=update.completion.stop_reason,
            )
        )

    def usage_chunk(self, totals: UsageInfo) -> str:
        return sse(self._chunk([], totals))

    def full(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=out.index,
                message=AssistantMessage(content=out.text),
                logprobs=self._logprobs(out, 0),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for out in output.outputs
        ]
        completion_tokens = sum(len(out.token_ids) for out in output.outputs)
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage(len(output.prompt_token_ids), completion_tokens),
        )


def _flatten_content(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it: content as one string."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise bad_request(
                    f"content parts of type {part.get('type')!r} are not supported; "
                    "this server accepts text only",
                    "messages",
                )
            texts.append(str(part.get("text", "")))
        data["content"] = "".join(texts)
    elif content is None:
        data["content"] = ""
    return data
