"""What becomes of assistant messages' reasoning when a conversation comes back, per the
model card's reasoning dialect (see `ReasoningDialect`). Pure Python: runs before the
chat template and needs no MLX."""

from typing import Any

from exo.shared.models.model_cards import ReasoningDialect
from exo.shared.types.text_generation import ChatMessage


def apply_reasoning_dialect(
    messages: list[ChatMessage],
    dialect: str,
    tools_in_play: bool,
) -> list[ChatMessage]:
    """The conversation with each assistant message's `reasoning_content` kept or
    dropped. `tools_in_play` says the request offers tools; tool calls or results in the
    conversation count too. Suffix models (Kimi) carry their reasoning in the content the
    client sends back, and their template places any reasoning field itself, so both
    stay as they came; folding the field into the content as well would repeat it."""
    match ReasoningDialect(dialect):
        case ReasoningDialect.channel | ReasoningDialect.suffix:
            return list(messages)
        case ReasoningDialect.none:
            return [_without_reasoning(m) for m in messages]
        case ReasoningDialect.tool_conditional if tools_in_play or _has_tool_traffic(messages):
            return list(messages)
        case ReasoningDialect.post_last_user | ReasoningDialect.tool_conditional:
            last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
            return [m if i > last_user else _without_reasoning(m) for i, m in enumerate(messages)]


def template_fields(message: ChatMessage, dialect: str) -> dict[str, Any]:
    """The reasoning as the chat template reads it: gpt-oss's template (channel) reads
    `thinking`; the others read `reasoning_content`. Empty when there is none."""
    if message.reasoning_content is None:
        return {}
    key = "thinking" if ReasoningDialect(dialect) is ReasoningDialect.channel else "reasoning_content"
    return {key: message.reasoning_content}


def _has_tool_traffic(messages: list[ChatMessage]) -> bool:
    return any(m.tool_calls or m.role == "tool" for m in messages)


def _without_reasoning(message: ChatMessage) -> ChatMessage:
    if message.role != "assistant" or message.reasoning_content is None:
        return message
    return message.model_copy(update={"reasoning_content": None})
