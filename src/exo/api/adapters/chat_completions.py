"""OpenAI Chat Completions <-> the internal task params and chunk stream. Pure functions."""

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    ChunkGenerated,
    TextGenerationTaskParams,
    Usage,
)


class ChatCompletionMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    enable_thinking: bool | None = None

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4:
            raise ValueError("stop accepts at most 4 sequences")
        return self


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
        enable_thinking=request.enable_thinking,
    )


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class ChunkEncoder:
    """Turns one request's chunk stream into chat.completion.chunk SSE lines."""

    def __init__(self, completion_id: str, model: str, include_usage: bool) -> None:
        self.completion_id = completion_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self._sent_role = False

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"

    def encode(self, chunk: ChunkGenerated) -> list[str]:
        if chunk.finish_reason == "error":
            message = chunk.error_message or "generation failed"
            return [
                f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'param': None, 'code': 'generation_failed'}})}\n\n"
            ]
        events = []
        delta: dict[str, Any] = {}
        if not self._sent_role:
            delta["role"] = "assistant"
            self._sent_role = True
        if chunk.text:
            delta["content"] = chunk.text
        if delta or chunk.finish_reason is not None:
            choice = {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason, "logprobs": None}
            extra = {"generation_stats": chunk.stats.model_dump(by_alias=False)} if chunk.stats else {}
            events.append(self._event([choice], **extra))
        if chunk.finish_reason is not None and self.include_usage and chunk.usage is not None:
            events.append(self._event([], usage=usage_body(chunk.usage)))
        return events


def completion_body(completion_id: str, model: str, chunks: list[ChunkGenerated]) -> dict[str, Any]:
    last = chunks[-1]
    usage = last.usage or Usage(prompt_tokens=0, completion_tokens=len(chunks))
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(c.text for c in chunks)},
                "finish_reason": last.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_body(usage),
        # Not in OpenAI's schema; clients ignore it. Speeds as the runner measured them.
        "generation_stats": last.stats.model_dump(by_alias=False) if last.stats else None,
    }
