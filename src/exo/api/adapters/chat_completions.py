"""OpenAI Chat Completions <-> the internal task params and chunk stream. Pure functions."""

import time
from typing import Annotated, Any, Literal

from llguidance import LLMatcher
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from exo.api.adapters.wire import (
    OPENAI_DONE,
    Encoder,
    Event,
    keep_alive_comment,
    prefill_only,
    sse_comment,
    sse_data,
)
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    ChunkGenerated,
    Speculative,
    TextGenerationTaskParams,
    ToolCall,
    Usage,
)

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# OpenAI's logit_bias: token id (a string key in JSON) -> bias added to its logit.
LogitBias = dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]]


class ChatCompletionMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Plain text or, for multimodal messages, a list of parts; either way an assistant
    # message can carry its reasoning beside it.
    content: str | list[dict[str, Any]] | None = None
    # `reasoning` is how some OpenAI-compatible clients (OpenRouter's) send it back.
    reasoning_content: str | None = Field(default=None, validation_alias=AliasChoices("reasoning_content", "reasoning"))
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # Aliased: `schema` would shadow a pydantic method.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        if self.json_schema is not None and self.json_schema.json_schema is not None:
            # The engine compiles the schema the same way; checking here makes a schema
            # it cannot use a 400 rather than a failed generation.
            grammar = LLMatcher.grammar_from_json_schema(self.json_schema.json_schema)
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
            if is_error:
                raise ValueError(f"response_format schema is not usable: {messages[0]}")
        return self


class ChatCompletionRequest(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers commonly do, so newer
    # clients keep working.
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[ChatCompletionMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    # exo's own: speculative decoding ({"method": "prompt_lookup", "num_draft": 8}); null
    # turns off the card's default.
    speculative: Speculative | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4:
            raise ValueError("stop accepts at most 4 sequences")
        return self


def asked_speculative(request: BaseModel) -> Speculative | Literal["off"] | None:
    """exo's `speculative` field as the request set it: absent leaves the card's default
    (None), null turns speculation off."""
    speculative = getattr(request, "speculative", None)
    if speculative is None and "speculative" in request.model_fields_set:
        return "off"
    return speculative


def to_task_params(request: ChatCompletionRequest) -> TextGenerationTaskParams:
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return TextGenerationTaskParams(
        model=ModelId(request.model),
        messages=[ChatMessage.model_validate(m.model_dump()) for m in request.messages],
        max_tokens=request.max_completion_tokens or request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=stop,
        tools=request.tools,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        tool_choice=request.tool_choice,
        enable_thinking=_enable_thinking(request),
        reasoning_effort=request.reasoning_effort,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=request.logit_bias,
        response_format=(
            request.response_format.model_dump(by_alias=True, exclude_none=True) if request.response_format else None
        ),
        speculative=asked_speculative(request),
    )


def _enable_thinking(request: ChatCompletionRequest) -> bool | None:
    """An explicit enable_thinking wins; otherwise an effort of none/minimal turns thinking
    off for models that can switch it, as the Responses adapter does."""
    if request.enable_thinking is not None or request.reasoning_effort is None:
        return request.enable_thinking
    return request.reasoning_effort not in ("none", "minimal")


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        # Proposals kept or not, in OpenAI's names for predicted outputs.
        "completion_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens,
            "accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.proposed_tokens - usage.accepted_tokens,
        },
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def logprobs_body(chunks: list[ChunkGenerated]) -> dict[str, Any] | None:
    """OpenAI's choice.logprobs: one entry per sampled token, with its alternatives."""
    entries = [entry for chunk in chunks for entry in chunk.logprobs or []]
    if not any(chunk.logprobs is not None for chunk in chunks):
        return None
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": _token_bytes(entry.token),
                "top_logprobs": [
                    {"token": alt.token, "logprob": alt.logprob, "bytes": _token_bytes(alt.token)}
                    for alt in entry.top_logprobs
                ],
            }
            for entry in entries
        ],
        "refusal": None,
    }


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatCompletionEncoder(Encoder):
    """Turns one request's chunks into chat.completion.chunk events, and keeps them so the
    same pass gives the chat.completion body."""

    closing = OPENAI_DONE

    def __init__(self, completion_id: str, model: str, include_usage: bool = False) -> None:
        self.completion_id = completion_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.chunks: list[ChunkGenerated] = []
        self._sent_role = False
        # OpenAI numbers streamed tool calls across the whole response, not per chunk.
        self._tool_calls_sent = 0

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> Event:
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def wire(self, event: Event) -> str:
        return sse_comment(event) or sse_data(event)

    def feed(self, chunk: ChunkGenerated) -> list[Event]:
        self.chunks.append(chunk)
        if chunk.finish_reason == "error":
            message = chunk.error_message or "generation failed"
            return [{"error": {"message": message, "type": "server_error", "param": None, "code": "generation_failed"}}]
        if prefill_only(chunk):
            return [keep_alive_comment(chunk)]
        events = []
        delta: dict[str, Any] = {}
        if not self._sent_role:
            delta["role"] = "assistant"
            self._sent_role = True
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
        if chunk.text:
            delta["content"] = chunk.text
        if chunk.tool_calls:
            delta["tool_calls"] = [
                {"index": self._tool_calls_sent + i, **tool_call_body(call)} for i, call in enumerate(chunk.tool_calls)
            ]
            self._tool_calls_sent += len(chunk.tool_calls)
        if delta or chunk.finish_reason is not None:
            choice = {
                "index": 0,
                "delta": delta,
                "finish_reason": chunk.finish_reason,
                "logprobs": logprobs_body([chunk]),
            }
            extra = {"generation_stats": chunk.stats.model_dump(by_alias=False)} if chunk.stats else {}
            events.append(self._event([choice], **extra))
        if chunk.finish_reason is not None and self.include_usage and chunk.usage is not None:
            events.append(self._event([], usage=usage_body(chunk.usage)))
        return events

    def body(self) -> Event:
        return completion_body(self.completion_id, self.model, self.chunks)


def completion_body(completion_id: str, model: str, chunks: list[ChunkGenerated]) -> dict[str, Any]:
    last = chunks[-1]
    usage = last.usage or Usage(prompt_tokens=0, completion_tokens=len(chunks))
    text = "".join(c.text for c in chunks)
    reasoning = "".join(c.reasoning for c in chunks)
    tool_calls = [tool_call_body(call) for c in chunks for call in c.tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls and not text else text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": last.finish_reason,
                "logprobs": logprobs_body(chunks),
            }
        ],
        "usage": usage_body(usage),
        # Not in OpenAI's schema; clients ignore it. Speeds as the runner measured them.
        "generation_stats": last.stats.model_dump(by_alias=False) if last.stats else None,
    }
