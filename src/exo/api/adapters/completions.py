"""OpenAI legacy Completions <-> the internal task params and chunk stream. Pure functions."""

import time
from typing import Any, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, model_validator

from exo.api.adapters.chat_completions import LogitBias, asked_speculative, usage_body
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
    FinishReason,
    Speculative,
    TextGenerationTaskParams,
    TokenLogprob,
    Usage,
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    # One prompt, as text or token ids; a batch of exactly one is accepted too.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: LogitBias | None = None
    speculative: Speculative | None = None  # exo's own, as on chat completions

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            self.prompt = self.prompt[0]
        if self.prompt in ("", []):
            raise ValueError("prompt must not be empty")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4:
            raise ValueError("stop accepts at most 4 sequences")
        return self

    def one_prompt(self) -> str | list[int]:
        """The prompt as text or token ids (`_one_prompt` has unwrapped a batch of one)."""
        prompt = self.prompt
        if isinstance(prompt, str) or _token_ids(prompt):
            return prompt
        raise AssertionError("_one_prompt leaves a single prompt, text or token ids")


def _token_ids(prompt: list[Any]) -> TypeGuard[list[int]]:
    return all(isinstance(token, int) for token in prompt)


def to_task_params(request: CompletionRequest, prompt_text: str) -> TextGenerationTaskParams:
    """`prompt_text` is the prompt as text (decoded when it came as token ids, empty when
    it could not be). The raw `prompt` is what the engine continues; the same text as a
    user message is the fallback for an engine that only takes messages."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return TextGenerationTaskParams(
        model=ModelId(request.model),
        messages=[ChatMessage(role="user", content=prompt_text)] if prompt_text else [],
        prompt=request.one_prompt(),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=stop,
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=request.logit_bias,
        speculative=asked_speculative(request),
    )


def finish_reason(reason: FinishReason | None) -> str | None:
    # Legacy Completions knows only stop, length and content_filter.
    return None if reason is None else "length" if reason == "length" else "stop"


class CompletionEncoder(Encoder):
    closing = OPENAI_DONE

    """Turns one request's chunks into text_completion stream events, and keeps the text
    so the same pass gives the non-streaming body. `echo` is the prompt text to send first."""

    def __init__(self, completion_id: str, model: str, echo: str = "", include_usage: bool = False) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.text = ""
        self._pending = echo
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.error: str | None = None
        self._logprobs: list[TokenLogprob] = []

    def _body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def feed(self, chunk: ChunkGenerated) -> list[dict[str, Any]]:
        if chunk.finish_reason == "error":
            self.error = chunk.error_message or "generation failed"
            return [
                {"error": {"message": self.error, "type": "server_error", "param": None, "code": "generation_failed"}}
            ]
        if prefill_only(chunk):
            return [keep_alive_comment(chunk)]
        text, self._pending = self._pending + chunk.text, ""
        self.text += text
        self.finish_reason = finish_reason(chunk.finish_reason)
        events = []
        self._logprobs.extend(chunk.logprobs or [])
        if text or self.finish_reason is not None:
            logprobs = legacy_logprobs(chunk.logprobs) if chunk.logprobs is not None else None
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
            events.append(self._body([choice]))
        if chunk.finish_reason is not None:
            self.usage = chunk.usage
            if self.include_usage and chunk.usage is not None:
                events.append(self._body([], usage=usage_body(chunk.usage)))
        return events

    def wire(self, event: Event) -> str:
        return sse_comment(event) or sse_data(event)

    def body(self) -> Event:
        logprobs = legacy_logprobs(self._logprobs) if self._logprobs else None
        choice = {"index": 0, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        usage = self.usage or Usage(prompt_tokens=0, completion_tokens=0)
        return self._body([choice], usage=usage_body(usage))


def legacy_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """The legacy Completions shape: parallel lists, alternatives as token -> logprob maps."""
    offsets, position = [], 0
    for entry in entries:
        offsets.append(position)
        position += len(entry.token)
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{alt.token: alt.logprob for alt in entry.top_logprobs} for entry in entries],
        "text_offset": offsets,
    }
