"""Anthropic Claude Messages <-> the internal task params and chunk stream. Pure functions."""

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from exo.api.adapters.wire import Encoder, Event, prefill_only, sse_typed
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, ChunkGenerated, FinishReason, TextGenerationTaskParams

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class ClaudeMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "system" is not in Anthropic's schema; such messages are folded into the system prompt.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ClaudeTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = {"type": "object", "properties": {}}


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ClaudeCountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    messages: list[ClaudeMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ClaudeTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class ClaudeMessagesRequest(ClaudeCountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if block.get("type") == "text")


def _image_part(block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    else:
        url = source.get("url", "")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_parts(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Plain text when there is nothing but text, which every chat template accepts."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _convert_message(message: ClaudeMessage) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    if message.role == "assistant":
        texts, thoughts, tool_calls = [], [], []
        for block in message.content:
            kind = block.get("type")
            if kind == "text":
                texts.append(block.get("text", ""))
            elif kind == "thinking":
                thoughts.append(block.get("thinking", ""))
            elif kind == "tool_use":
                arguments = json.dumps(block.get("input") or {})
                function = {"name": block.get("name", ""), "arguments": arguments}
                tool_calls.append({"id": block.get("id", ""), "type": "function", "function": function})
        return [
            ChatMessage(
                role="assistant",
                content="".join(texts),
                reasoning_content="".join(thoughts) or None,
                tool_calls=tool_calls or None,
            )
        ]
    # Tool results answer the previous assistant turn, so they come before the user's text.
    results: list[ChatMessage] = []
    parts: list[dict[str, Any]] = []
    for block in message.content:
        kind = block.get("type")
        if kind == "tool_result":
            content = block.get("content")
            text = _text_of(content) if not isinstance(content, str) else content
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(ChatMessage(role="tool", content=text, tool_call_id=block.get("tool_use_id")))
        elif kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append(_image_part(block))
    if parts or not results:
        results.append(ChatMessage(role=message.role, content=_user_parts(parts)))
    return results


def to_chat_messages(request: ClaudeCountTokensRequest) -> list[ChatMessage]:
    system = [_text_of(request.system)] if request.system else []
    converted: list[ChatMessage] = []
    for message in request.messages:
        if message.role == "system":
            system.append(_text_of(message.content))
        else:
            converted.extend(_convert_message(message))
    prefix = [ChatMessage(role="system", content="\n\n".join(system))] if system else []
    return prefix + converted


def _tools(request: ClaudeCountTokensRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    return [
        {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema},
        }
        for tool in request.tools
    ]


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _enable_thinking(thinking: ThinkingConfig | None) -> bool | None:
    return None if thinking is None else thinking.type != "disabled"


def to_task_params(request: ClaudeMessagesRequest) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId(request.model),
        messages=to_chat_messages(request),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stop=list(request.stop_sequences or []),
        tools=_tools(request),
        tool_choice=_tool_choice(request.tool_choice),
        enable_thinking=_enable_thinking(request.thinking),
    )


def prompt_text(request: ClaudeCountTokensRequest) -> str:
    """Everything the prompt says, as text: what count_tokens measures."""
    pieces = []
    for message in to_chat_messages(request):
        pieces += [_text_of(message.content), message.reasoning_content or ""]
        pieces += [json.dumps(call) for call in message.tool_calls or []]
    pieces += [json.dumps(tool) for tool in _tools(request) or []]
    return "\n".join(piece for piece in pieces if piece)


def approximate_token_count(text: str) -> int:
    """About four characters a token for English text, when no tokenizer is at hand."""
    return math.ceil(len(text) / 4)


def stop_reason(finish_reason: FinishReason | None, stop_sequence: str | None = None) -> StopReason:
    if stop_sequence is not None:
        return "stop_sequence"
    reasons: dict[FinishReason, StopReason] = {"length": "max_tokens", "tool_calls": "tool_use"}
    return reasons.get(finish_reason or "stop", "end_turn")


class MessageEncoder(Encoder):
    """Turns one request's chunks into Messages stream events, and keeps the content
    blocks so the same pass also gives the non-streaming body."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.blocks: list[dict[str, Any]] = []
        self._open = False
        self._started = False
        self.input_tokens = 0
        # Of the prompt, the tokens an earlier request's cache already held.
        self.cached_tokens = 0
        self.output_tokens = 0
        self.stop_reason: StopReason | None = None
        self.stop_sequence: str | None = None
        self.error: str | None = None

    def _message(self) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self._usage(),
        }

    def _usage(self) -> dict[str, int]:
        """Anthropic's split: `input_tokens` are the prompt tokens read fresh, those the
        prefix cache held are `cache_read_input_tokens` (exo caches on its own, so none
        are written on request)."""
        return {
            "input_tokens": self.input_tokens - self.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
        }

    def _close_block(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _append(self, kind: Literal["text", "thinking"], text: str) -> list[dict[str, Any]]:
        events = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            events += self._close_block()
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": ""}
            if kind == "thinking":
                block["signature"] = ""
            self.blocks.append(block)
            self._open = True
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        self.blocks[-1][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        return events

    def feed(self, chunk: ChunkGenerated) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            if chunk.prefill is not None:
                self.input_tokens = chunk.prefill.total_tokens
            start = {**self._message(), "content": []}
            events.append({"type": "message_start", "message": start})
        if chunk.finish_reason == "error":
            self.error = chunk.error_message or "generation failed"
            return events + [{"type": "error", "error": {"type": "api_error", "message": self.error}}]
        if prefill_only(chunk):
            # As Anthropic's API does while it reads a long prompt.
            return events + [{"type": "ping"}]
        if chunk.reasoning:
            events += self._append("thinking", chunk.reasoning)
        if chunk.text:
            events += self._append("text", chunk.text)
        for call in chunk.tool_calls:
            events += self._close_block()
            self.blocks.append(
                {"type": "tool_use", "id": call.id, "name": call.name, "input": _arguments(call.arguments)}
            )
            index = len(self.blocks) - 1
            start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events += [
                {"type": "content_block_start", "index": index, "content_block": start},
                {"type": "content_block_delta", "index": index, "delta": delta},
                {"type": "content_block_stop", "index": index},
            ]
        if chunk.finish_reason is not None:
            events += self._close_block()
            if chunk.usage is not None:
                self.input_tokens = chunk.usage.prompt_tokens
                self.cached_tokens = chunk.usage.cached_tokens
                self.output_tokens = chunk.usage.completion_tokens
            self.stop_reason = stop_reason(chunk.finish_reason, chunk.stop_sequence)
            self.stop_sequence = chunk.stop_sequence
            delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
            events += [{"type": "message_delta", "delta": delta, "usage": self._usage()}, {"type": "message_stop"}]
        return events

    def wire(self, event: Event) -> str:
        return sse_typed(event)

    def body(self) -> Event:
        return self._message()


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
