"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Field names, defaults and shapes follow the OpenAI API reference; fields marked
"extension" are vLLM's additions that OpenAI does not have. Unknown request fields are
ignored, as OpenAI's own server does for forward compatibility.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

# Upper bound on top alternatives per token (OpenAI allows 5 for completions, 20 for chat).
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIModel):
    """A request body: every string in it must be encodable as UTF-8.

    JSON can carry a lone UTF-16 surrogate (`"\\ud800"`) that Python accepts as text but no
    tokenizer or UTF-8 encoder does; such input is refused here, naming the field.
    """

    @field_validator("*", mode="after")
    @classmethod
    def _encodable(cls, value: Any, info: ValidationInfo) -> Any:
        _check_encodable(value, info.field_name)
        return value


def _check_encodable(value: Any, field: str | None) -> None:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"{field} holds a lone UTF-16 surrogate ({value[exc.start]!a}) at character "
                    f"{exc.start}, which is not valid Unicode text; send valid UTF-8"
                ) from None
    elif isinstance(value, list):
        # Lists of numbers (token ids) are the long ones; they hold no text.
        if value and isinstance(value[0], (str, list, dict)):
            for item in value:
                _check_encodable(item, field)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key, field)
            _check_encodable(item, field)


# ----------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- shared


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class SamplingFields(RequestModel):
    """Sampling fields common to both endpoints."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None  # extension; -1 or 0 = off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # extension
    logit_bias: dict[str, float] | None = None  # refused if non-empty
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0)  # extension
    skip_special_tokens: bool = True  # extension
    include_stop_str_in_output: bool = False  # extension
    user: str | None = None


# ----------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with echo: the prompt and its logprobs, nothing generated (vLLM's extension).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None  # refused if set
    best_of: int | None = None  # refused unless equal to n


class CompletionLogprobs(OpenAIModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # extension: the stop string or token id


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ----------------------------------------------------------------------------- chat


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: Literal[CHAT_ROLES]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # extension
    continue_final_message: bool = False  # extension
    chat_template: str | None = None  # extension; refused unless the server trusts it
    chat_template_kwargs: dict[str, Any] | None = None  # extension
    tools: list[dict[str, Any]] | None = None  # refused if non-empty
    response_format: dict[str, Any] | None = None  # only {"type": "text"}


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # extension


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(OpenAIModel):
    """A streamed piece of the reply; fields without a value are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ----------------------------------------------------------------------------- models, tokens


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ssmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """Either `prompt` (text) or `messages` (rendered through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False  # extension: also each token's vocabulary string


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
