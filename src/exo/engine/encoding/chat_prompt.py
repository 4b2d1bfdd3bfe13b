"""The prompt text of a chat request, MLX-free: the model's chat template applied to the
messages as exo passes them (reasoning dialect, tool calls with their arguments as
objects), or for DeepSeek V3.2 and V4 exo's encoders of the published format. The engine
renders with it, and the API counts a prompt's tokens with it before sending the request."""

import json
from typing import Any

from exo.engine.encoding import deepseek_v4, deepseek_v32
from exo.engine.parsing.reasoning import repair_unmatched_end
from exo.engine.reasoning_dialect import apply_reasoning_dialect, template_fields
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams


def template_message(message: ChatMessage, dialect: str = "none") -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    rendered: dict[str, Any] = {"role": role, "content": template_content(message)}
    rendered.update(template_fields(message, dialect))
    if message.tool_calls:
        rendered["tool_calls"] = [template_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    return rendered


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """The call with its arguments as an object. OpenAI clients send them as JSON text, but
    templates that write each argument in their own markup (GLM's arg_key/arg_value,
    MiniMax's parameter elements, Gemma 4's call:name{key:value}) iterate over a mapping,
    and templates that want text write the mapping with tojson."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def template_content(message: ChatMessage) -> str | list[dict[str, Any]]:
    """Plain text, or for a message with images the parts vision templates iterate over
    (each image a {"type": "image"} part where the template writes its placeholder)."""
    if isinstance(message.content, list) and any(part.get("type") == "image" for part in message.content):
        return [
            {"type": "image"} if part.get("type") == "image" else {"type": "text", "text": part.get("text", "")}
            for part in message.content
            if part.get("type") in ("image", "text")
        ]
    return message_text(message)


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.get("text", "") for part in message.content if part.get("type") == "text")


def render_prompt(tokenizer: Any, params: TextGenerationTaskParams, model_type: str, dialect: str = "none") -> str:
    """The prompt text for a chat request. The card's reasoning dialect decides which
    earlier reasoning goes back to the model, and how. DeepSeek V3.2 and V4 ship no Jinja
    template; their prompts come from exo's encoders of the published format.

    `tokenizer` is mlx-lm's TokenizerWrapper in the engine, a transformers tokenizer in the
    API: anything with `chat_template` and `apply_chat_template`."""
    chat = apply_reasoning_dialect(params.messages, dialect, bool(params.tools))
    thinking = params.enable_thinking is not False
    if model_type == "deepseek_v4":
        return deepseek_v4.encode_messages(chat, params.tools, thinking, params.reasoning_effort)
    if model_type == "deepseek_v32":
        return deepseek_v32.encode_messages(chat, params.tools, thinking, params.reasoning_effort)
    messages = [template_message(m, dialect) for m in chat]
    if tokenizer.chat_template is None:
        # Base models have no template: plain concatenation is the honest fallback.
        return "\n".join(message_text(m) for m in chat)
    extra: dict[str, Any] = {}
    if params.enable_thinking is not None:
        extra["enable_thinking"] = params.enable_thinking
    if params.reasoning_effort is not None:
        extra["reasoning_effort"] = params.reasoning_effort
    return tokenizer.apply_chat_template(
        messages, tools=params.tools, add_generation_prompt=True, tokenize=False, **extra
    )


def processor_adds_special_tokens(tokenizer: Any, text: str) -> bool:
    """Whether a VLM's processor tokenizes `text` with the tokenizer's special tokens:
    transformers' ProcessorMixin.apply_chat_template adds them unless the prompt starts
    with BOS, so a template that writes none still gets the one a Gemma tokenizer adds."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (isinstance(bos, str) and bos and text.startswith(bos))


def encode_prompt(
    tokenizer: Any,
    params: TextGenerationTaskParams,
    model_type: str = "",
    dialect: str = "none",
    think_markers: tuple[str, str] | None = None,
    as_processor: bool = False,
) -> tuple[list[int], str]:
    """Prompt token ids and text, as every engine feeds them. A raw prompt (text or ids) is
    used as it is. `tokenizer` has `encode(text, add_special_tokens=...)` and `decode`.
    `as_processor`: tokenized as a VLM's processor does (a prompt with images)."""
    if isinstance(params.prompt, list):
        return list(params.prompt), tokenizer.decode(params.prompt)
    if params.prompt is not None:
        return tokenizer.encode(params.prompt, add_special_tokens=False), params.prompt
    text = render_prompt(tokenizer, params, model_type, dialect)
    # The template already wrote any BOS it wants; a processor may add one.
    tokens = tokenizer.encode(text, add_special_tokens=as_processor and processor_adds_special_tokens(tokenizer, text))
    if think_markers is not None:
        # An answer sent back as "thought</think>answer" (its start was in the earlier
        # generation prompt) would leave an end marker the model never saw opened.
        start_ids, end_ids = (tokenizer.encode(marker, add_special_tokens=False) for marker in think_markers)
        tokens = repair_unmatched_end(tokens, start_ids, end_ids)
    return tokens, text
