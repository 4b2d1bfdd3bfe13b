"""Turning chat messages into prompt tokens with the model's own chat template."""

from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams


def template_message(message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    rendered: dict[str, Any] = {"role": role, "content": message_text(message)}
    if message.reasoning_content:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        rendered["tool_calls"] = message.tool_calls
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    return rendered


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.get("text", "") for part in message.content if part.get("type") == "text")


def encode_prompt(tokenizer: TokenizerWrapper, params: TextGenerationTaskParams) -> list[int]:
    messages = [template_message(m) for m in params.messages]
    extra: dict[str, Any] = {}
    if params.enable_thinking is not None:
        extra["enable_thinking"] = params.enable_thinking
    if tokenizer.chat_template is None:
        # Base models have no template: plain concatenation is the honest fallback.
        prompt = "\n".join(m["content"] for m in messages)
    else:
        prompt = tokenizer.apply_chat_template(
            messages, tools=params.tools, add_generation_prompt=True, tokenize=False, **extra
        )
    # The template already wrote any BOS it wants.
    return tokenizer.encode(prompt, add_special_tokens=False)
