"""DeepSeek V3.2's prompt format, rendered by the encoder mlx-lm ships for it.

V3.2 ships a Python encoder rather than a Jinja template; mlx-lm carries it as
`mlx_lm.chat_templates.deepseek_v32`. This module only prepares the messages the way that
encoder expects and applies exo's rules on top:

- all system and developer text goes into one leading system message, and the tool list
  is rendered into it (an empty one is added when tools are offered and there is none);
- tool_conditional reasoning: with tools offered, earlier reasoning is not dropped;
- earlier answers lose any `<think>` blocks a client echoed back in the content;
- tool results are put in the order of the calls, because V3.2 links a result to its
  call only by position.

V3.2 wraps tool calls in a `<｜DSML｜function_calls>` block (V4 says `tool_calls`); the
invoke and parameter elements inside are the same."""

from itertools import groupby
from typing import Any

from exo.engine.encoding import arguments_json, content_text, split_prefill, system_text
from exo.engine.encoding.deepseek_v4 import strip_thinking
from exo.shared.types.text_generation import ChatMessage

TOOL_CALLS_BLOCK = "function_calls"


def encode_messages(
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """The full V3.2 prompt, ending with the generation prompt (or with the text of a
    trailing assistant message, which generation then continues). V3.2 has no effort
    setting; `reasoning_effort` is accepted so both DeepSeek encoders share a signature."""
    # Imported here: importing mlx_lm loads MLX, and the node process (whose API counts
    # prompts with this encoder) otherwise never does.
    from mlx_lm.chat_templates import deepseek_v32

    history, prefill = split_prefill(messages)
    prompt = deepseek_v32.encode_messages(
        _template_messages(history, tools),
        thinking_mode="thinking" if thinking else "chat",
        # tool_conditional: V3.2 chains tool calls on its earlier reasoning.
        drop_thinking=not tools,
        tools=tools or None,
    )
    return prompt + (prefill or "")


def _template_messages(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    rendered: list[dict[str, Any]] = []
    system = system_text(messages)
    if system is not None or tools:
        rendered.append({"role": "system", "content": system or ""})
    for message in _tool_results_in_call_order(messages):
        if message.role == "assistant":
            rendered.append(_assistant_message(message))
        elif message.role in ("user", "tool"):
            rendered.append({"role": message.role, "content": content_text(message.content)})
    return rendered


def _assistant_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": "assistant", "content": strip_thinking(content_text(message.content))}
    if message.reasoning_content:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        rendered["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
    return rendered


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    # The shipped encoder parses the arguments with json.loads, so they must be JSON text.
    function = call.get("function", call)
    return {"function": {"name": function.get("name", ""), "arguments": arguments_json(function.get("arguments", {}))}}


def _tool_results_in_call_order(messages: list[ChatMessage]) -> list[ChatMessage]:
    ordered: list[ChatMessage] = []
    call_order: dict[str, int] = {}
    for is_tool, run in groupby(messages, key=lambda message: message.role == "tool"):
        group = list(run)
        if is_tool:
            group.sort(key=lambda result: call_order.get(result.tool_call_id or "", 0))
        for message in group:
            if message.role == "assistant" and message.tool_calls:
                call_order = {call["id"]: i for i, call in enumerate(message.tool_calls) if call.get("id")}
        ordered.extend(group)
    return ordered
