"""Ollama's /api/chat and /api/generate <-> the internal task params and chunk stream,
and the model listings. Pure functions."""

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from exo.api.adapters.wire import NDJSON, Encoder, Event, ndjson
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, ChunkGenerated, TextGenerationTaskParams, Usage


class Options(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    # -1 (no limit) and -2 (fill the context) both mean: no max_tokens.
    num_predict: int | None = None
    stop: list[str] | None = None


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class OllamaRequestBase(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    stream: bool = True
    think: bool | Literal["low", "medium", "high"] | None = None
    options: Options = Options()


class OllamaChatRequest(OllamaRequestBase):
    messages: list[OllamaMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaRequestBase):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


def _content(text: str | None, images: list[str] | None) -> str | list[dict[str, Any]]:
    if not images:
        return text or ""
    # Ollama sends bare base64 (api/images.py finds the real format) and puts a message's
    # images before its text.
    parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}} for image in images]
    return [*parts, {"type": "text", "text": text or ""}]


def _tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    converted = []
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        arguments = function.get("arguments") or {}
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        function = {"name": function.get("name", ""), "arguments": text}
        converted.append({"id": call.get("id") or f"call_{index}", "type": "function", "function": function})
    return converted


def _chat_message(message: OllamaMessage) -> ChatMessage:
    return ChatMessage(
        role=message.role,
        content=_content(message.content, message.images),
        reasoning_content=message.thinking,
        tool_calls=_tool_calls(message.tool_calls),
        name=message.tool_name,
    )


def _sampling(request: OllamaRequestBase) -> dict[str, Any]:
    options = request.options
    num_predict = options.num_predict
    return {
        "model": ModelId(request.model),
        "max_tokens": num_predict if num_predict is not None and num_predict > 0 else None,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "min_p": options.min_p,
        "seed": options.seed,
        "stop": list(options.stop or []),
        "enable_thinking": None if request.think is None else request.think is not False,
    }


def chat_task_params(request: OllamaChatRequest) -> TextGenerationTaskParams:
    messages = [_chat_message(message) for message in request.messages]
    return TextGenerationTaskParams(messages=messages, tools=request.tools, **_sampling(request))


def generate_task_params(request: OllamaGenerateRequest) -> TextGenerationTaskParams:
    user = ChatMessage(role="user", content=_content(request.prompt, request.images))
    if request.raw:
        # The raw prompt is what the engine continues; the user message is the fallback
        # for an engine that only takes messages.
        return TextGenerationTaskParams(messages=[user], prompt=request.prompt, **_sampling(request))
    system = [ChatMessage(role="system", content=request.system)] if request.system else []
    return TextGenerationTaskParams(messages=[*system, user], **_sampling(request))


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class OllamaEncoder(Encoder):
    """Turns one request's chunks into Ollama's NDJSON objects, and keeps the answer so
    the same pass gives the non-streaming body."""

    media_type = NDJSON

    def __init__(
        self,
        model: str,
        kind: Literal["chat", "generate"],
        started_ns: int,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.model = model
        self.kind = kind
        self.started_ns = started_ns
        self.clock = clock
        self.text = ""
        self.thinking = ""
        self.tool_calls: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}
        self.error: str | None = None

    def _object(self, text: str, thinking: str, tool_calls: list[dict[str, Any]], done: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            body["message"] = message
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        return {**body, "done": done}

    def feed(self, chunk: ChunkGenerated) -> list[Event]:
        if chunk.finish_reason == "error":
            self.error = chunk.error_message or "generation failed"
            return [{"error": self.error}]
        calls = [
            {"function": {"name": call.name, "arguments": _arguments(call.arguments)}} for call in chunk.tool_calls
        ]
        self.text += chunk.text
        self.thinking += chunk.reasoning
        self.tool_calls += calls
        objects = []
        if chunk.text or chunk.reasoning or calls:
            objects.append(self._object(chunk.text, chunk.reasoning, calls, done=False))
        if chunk.finish_reason is not None:
            self.final = self._final_fields(chunk, self.clock())
            objects.append({**self._object("", "", [], done=True), **self.final})
        return objects

    def _final_fields(self, chunk: ChunkGenerated, now_ns: int) -> dict[str, Any]:
        usage = chunk.usage or Usage(prompt_tokens=0, completion_tokens=0)
        stats = chunk.stats
        prompt_ns = int(usage.prompt_tokens / stats.prompt_tps * 1e9) if stats and stats.prompt_tps else 0
        eval_ns = int(usage.completion_tokens / stats.generation_tps * 1e9) if stats and stats.generation_tps else 0
        return {
            "done_reason": "length" if chunk.finish_reason == "length" else "stop",
            "total_duration": now_ns - self.started_ns,
            "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": prompt_ns,
            "eval_count": usage.completion_tokens,
            "eval_duration": eval_ns,
        }

    def wire(self, event: Event) -> str:
        return ndjson(event)

    def body(self) -> Event:
        return {**self._object(self.text, self.thinking, self.tool_calls, done=True), **self.final}


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def details(card: ModelCard) -> dict[str, Any]:
    return {
        "parent_model": card.base_model,
        "format": "safetensors",
        "family": card.family,
        "families": [card.family] if card.family else None,
        "parameter_size": "",
        "quantization_level": card.quantization,
    }


def model_entry(card: ModelCard) -> dict[str, Any]:
    return {
        "name": card.model_id,
        "model": card.model_id,
        "modified_at": "1970-01-01T00:00:00Z",
        "size": card.storage_size.in_bytes,
        "digest": "",
        "details": details(card),
    }


def show_body(card: ModelCard, thinks: bool) -> dict[str, Any]:
    """`thinks`: whether the engine splits the model's reasoning off (its think markers)."""
    capabilities = ["completion"] + (["vision"] if "vision" in card.capabilities else [])
    capabilities += ["thinking"] if thinks or card.reasoning_dialect.value != "none" else []
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": details(card),
        "model_info": {
            "general.architecture": card.family,
            "general.block_count": card.n_layers,
            "general.context_length": card.context_length,
            "general.embedding_length": card.hidden_size,
        },
        "capabilities": capabilities,
        "modified_at": "1970-01-01T00:00:00Z",
    }
