"""OpenAI Responses <-> the internal task params and chunk stream. Pure functions."""

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from exo.api.adapters.chat_completions import asked_speculative
from exo.api.adapters.wire import Encoder, Event, keep_alive_comment, prefill_only, sse_comment, sse_typed
from exo.shared.types.common import ModelId, new_id
from exo.shared.types.text_generation import ChatMessage, ChunkGenerated, Speculative, TextGenerationTaskParams


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    effort: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    speculative: Speculative | None = None  # exo's own, as on chat completions


def _content(content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]]:
    """Input parts in Chat Completions' shape; plain text when that is all there is."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url") or ""}})
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _text(content: Any) -> str:
    converted = _content(content)
    return converted if isinstance(converted, str) else ""


def to_chat_messages(request: ResponsesRequest) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
    if isinstance(request.input, str):
        return messages + [ChatMessage(role="user", content=request.input)]
    reasoning: list[str] = []
    for item in request.input:
        kind = item.get("type", "message")
        if kind == "reasoning":
            # Thinking belongs to the assistant turn that follows it.
            reasoning += [part.get("text", "") for part in item.get("content") or []]
            continue
        if kind == "message" and item.get("role") != "assistant":
            messages.append(ChatMessage(role=item.get("role", "user"), content=_content(item.get("content"))))
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output)
            messages.append(ChatMessage(role="tool", content=text, tool_call_id=item.get("call_id")))
        elif kind in ("message", "function_call"):
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant" or reasoning:
                last = ChatMessage(role="assistant", content="", reasoning_content="".join(reasoning) or None)
                messages.append(last)
                reasoning = []
            if kind == "message":
                update = {"content": _text(last.content) + _text(item.get("content"))}
            else:
                function = {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}
                call = {"id": item.get("call_id", ""), "type": "function", "function": function}
                update = {"tool_calls": [*(last.tool_calls or []), call]}
            messages[-1] = last.model_copy(update=update)
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in Chat Completions' nested shape; built-in tools
    (web search and the like) need the hosted service and are left out."""
    functions = [tool for tool in tools or [] if tool.get("type") == "function"]
    if not functions:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool.get("name", ""),
                "description": tool.get("description") or "",
                "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for tool in functions
    ]


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _enable_thinking(reasoning: ReasoningConfig | None) -> bool | None:
    if reasoning is None or reasoning.effort is None:
        return None
    return reasoning.effort not in ("none", "minimal")


def to_task_params(request: ResponsesRequest) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId(request.model),
        messages=to_chat_messages(request),
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        tools=_tools(request.tools),
        tool_choice=_tool_choice(request.tool_choice),
        enable_thinking=_enable_thinking(request.reasoning),
        speculative=asked_speculative(request),
    )


class ResponseEncoder(Encoder):
    """Turns one request's chunks into Responses stream events (numbered), and keeps the
    output items so the same pass gives the final response object."""

    def __init__(self, request: ResponsesRequest, response_id: str | None = None) -> None:
        self.request = request
        self.response_id = response_id or f"resp_{new_id()}"
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self._open: Literal["message", "reasoning"] | None = None
        self._sequence = 0

    def wire(self, event: Event) -> str:
        return sse_comment(event) or sse_typed(event)

    def body(self) -> Event:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.request.model,
            "status": self.status,
            "output": self.output,
            "instructions": self.request.instructions,
            "max_output_tokens": self.request.max_output_tokens,
            "temperature": self.request.temperature,
            "top_p": self.request.top_p,
            "tools": self.request.tools or [],
            "tool_choice": self.request.tool_choice or "auto",
            "parallel_tool_calls": self.request.parallel_tool_calls,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "error": {"code": "server_error", "message": self.error} if self.error else None,
            "usage": self.usage,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.body()),
            self._event("response.in_progress", response=self.body()),
        ]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        part = item["content"][0]
        done_kind = "response.output_text.done" if self._open == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if self._open == "message" else {}
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        item["status"] = "completed"
        self._open = None
        return [
            self._event(done_kind, **where, text=part["text"], **extra),
            self._event("response.content_part.done", **where, part=dict(part)),
            self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))),
        ]

    def _append(self, kind: Literal["message", "reasoning"], text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self._close()
            if kind == "message":
                item = {"type": "message", "id": f"msg_{new_id()}", "role": "assistant", "status": "in_progress"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"type": "reasoning", "id": f"rs_{new_id()}", "summary": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            self.output.append({**item, "content": []})
            index = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=index, item={**item, "content": []}))
            self.output[-1]["content"].append(part)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append(self._event("response.content_part.added", **where, part=dict(part)))
            self._open = kind
        item = self.output[-1]
        item["content"][0]["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def feed(self, chunk: ChunkGenerated) -> list[dict[str, Any]]:
        if chunk.finish_reason == "error":
            self.error = chunk.error_message or "generation failed"
            self.status = "failed"
            return self._close() + [self._event("response.failed", response=self.body())]
        if prefill_only(chunk):
            return [keep_alive_comment(chunk)]
        events: list[dict[str, Any]] = []
        if chunk.reasoning:
            events += self._append("reasoning", chunk.reasoning)
        if chunk.text:
            events += self._append("message", chunk.text)
        for call in chunk.tool_calls:
            events += self._close()
            item = {
                "type": "function_call",
                "id": f"fc_{new_id()}",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
                "status": "in_progress",
            }
            index = len(self.output)
            self.output.append({**item, "arguments": call.arguments, "status": "completed"})
            where = {"item_id": item["id"], "output_index": index}
            events += [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=dict(self.output[-1])),
            ]
        if chunk.finish_reason is not None:
            events += self._close()
            if chunk.usage is not None:
                self.usage = {
                    "input_tokens": chunk.usage.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": chunk.usage.cached_tokens, "cache_write_tokens": 0},
                    "output_tokens": chunk.usage.completion_tokens,
                    "output_tokens_details": {
                        "reasoning_tokens": chunk.usage.reasoning_tokens,
                        "accepted_prediction_tokens": chunk.usage.accepted_tokens,
                        "rejected_prediction_tokens": chunk.usage.proposed_tokens - chunk.usage.accepted_tokens,
                    },
                    "total_tokens": chunk.usage.total_tokens,
                }
            # As OpenAI does: running out of max_output_tokens makes the response incomplete.
            self.status = "incomplete" if chunk.finish_reason == "length" else "completed"
            events.append(self._event(f"response.{self.status}", response=self.body()))
        return events
