"""Prompt encoders for model families that ship a Python encoder instead of a Jinja chat
template (DeepSeek V3.2 and V4), and the message preparation they share.

Both encoders expect what upstream exo hands them: every system and developer message
folded into one leading system message, plain-text content, and tool-call arguments as
JSON text. A trailing assistant message is a prefill: the prompt ends with its text so
generation continues it."""

import json
from typing import Any

from exo.shared.types.text_generation import ChatMessage


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of a message; of a multimodal message, its text parts run together."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def split_prefill(messages: list[ChatMessage]) -> tuple[list[ChatMessage], str | None]:
    """The history to encode, and the text of a trailing assistant message to continue."""
    if messages and messages[-1].role == "assistant":
        return messages[:-1], content_text(messages[-1].content)
    return messages, None


def system_text(messages: list[ChatMessage]) -> str | None:
    """The one system message the encoders get: all system and developer texts, in order.
    None when there are none (an empty one is only added when tools need a home)."""
    parts = [content_text(m.content) for m in messages if m.role in ("system", "developer")]
    return "\n".join(part for part in parts if part) or None


def arguments_json(arguments: Any) -> str:
    """Tool-call arguments as JSON text; some clients send the object itself."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)
