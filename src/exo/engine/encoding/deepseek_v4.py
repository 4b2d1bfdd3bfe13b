"""DeepSeek V4's prompt format.

V4 ships no Jinja chat template, only a Python encoder; this follows its layout. A prompt
is BOS, the system text (the tool list appended when tools are offered), then turns:

    <｜User｜>question<｜Assistant｜><think>reasoning</think>answer<｜end▁of▁sentence｜>

Tool results have no role of their own: a run of tool and user messages becomes one user
turn whose parts are `<tool_result>...</tool_result>` blocks and text, joined by blank
lines. An assistant's tool calls follow its answer as a DSML block (see TOOLS_PROMPT).

Thinking mode opens the answer with `<think>`; chat mode closes it at once with
`</think>`. Earlier turns lose their reasoning (their answer follows a bare `</think>`),
except when tools are offered: V4 chains tool calls on its earlier reasoning, so then
every assistant turn keeps it and every generation prompt opens a thinking block."""

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from exo.engine.encoding import arguments_json, content_text, split_prefill, system_text
from exo.shared.types.text_generation import ChatMessage

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML_TOKEN = "｜DSML｜"
TOOL_CALLS_BLOCK = "tool_calls"

# Put before everything else when the client asks for the most effort ("xhigh").
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# The model was trained on this exact text, so it is reproduced byte for byte.
TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_THINK_BLOCK = re.compile(re.escape(THINK_START) + ".*?" + re.escape(THINK_END), re.DOTALL)


@dataclass
class _Part:
    """One part of a user turn: typed text, or the result of a tool call."""

    text: str
    is_tool_result: bool = False
    tool_call_id: str = ""

    def render(self) -> str:
        return f"<tool_result>{self.text}</tool_result>" if self.is_tool_result else self.text


@dataclass
class _Turn:
    role: Literal["system", "user", "assistant"]
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parts: list[_Part] = field(default_factory=list)


def encode_messages(
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = True,
    reasoning_effort: str | None = None,
) -> str:
    """The full V4 prompt for a conversation, ending with the generation prompt (or with
    the text of a trailing assistant message, which generation then continues)."""
    history, prefill = split_prefill(messages)
    turns = _sort_tool_results(_turns(history, tools))
    # tool_conditional: with tools, earlier reasoning stays so tool chains stay coherent.
    keep_reasoning = bool(tools)
    last_user = max((i for i, turn in enumerate(turns) if turn.role == "user"), default=-1)

    prompt = BOS
    if turns and thinking and reasoning_level(reasoning_effort) == "max":
        prompt += REASONING_EFFORT_MAX
    for index, turn in enumerate(turns):
        if turn.role == "system":
            prompt += turn.text + ("\n\n" + render_tools(tools) if tools else "")
        elif turn.role == "user":
            # Turns alternate after merging, so a user turn is always answered next.
            opens_thinking = thinking and (keep_reasoning or index == last_user)
            prompt += USER + "\n\n".join(part.render() for part in turn.parts)
            prompt += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
        else:
            shows_reasoning = thinking and (keep_reasoning or index > last_user)
            prompt += _render_assistant(turn, shows_reasoning)
    return prompt + (prefill or "")


def reasoning_level(reasoning_effort: str | None) -> Literal["max", "high"] | None:
    """The API's effort names mapped to V4's: only "max" changes the prompt today."""
    if reasoning_effort in ("xhigh", "max"):
        return "max"
    if reasoning_effort == "high":
        return "high"
    return None


def render_tools(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(_to_json(tool.get("function", tool)) for tool in tools)
    return TOOLS_PROMPT.format(dsml=DSML_TOKEN, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """OpenAI-format tool calls as the DSML block the model would have written."""
    invokes = "\n".join(_render_invoke(call.get("function", call)) for call in tool_calls)
    return f"<{DSML_TOKEN}{TOOL_CALLS_BLOCK}>\n{invokes}\n</{DSML_TOKEN}{TOOL_CALLS_BLOCK}>"


def strip_thinking(text: str) -> str:
    """An earlier answer without any `<think>` blocks or stray markers clients echoed back:
    its reasoning, if kept, travels in reasoning_content instead."""
    return _THINK_BLOCK.sub("", text).replace(THINK_START, "").replace(THINK_END, "")


def _turns(messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> list[_Turn]:
    turns: list[_Turn] = []
    system = system_text(messages)
    if system is not None or tools:
        turns.append(_Turn(role="system", text=system or ""))
    for message in messages:
        if message.role == "assistant":
            turns.append(_assistant_turn(message))
        elif message.role in ("user", "tool"):
            # Consecutive user and tool messages share one user turn.
            if not turns or turns[-1].role != "user":
                turns.append(_Turn(role="user"))
            turns[-1].parts.append(_user_part(message))
    return turns


def _assistant_turn(message: ChatMessage) -> _Turn:
    return _Turn(
        role="assistant",
        text=strip_thinking(content_text(message.content)),
        reasoning=message.reasoning_content or "",
        tool_calls=list(message.tool_calls or []),
    )


def _user_part(message: ChatMessage) -> _Part:
    if message.role == "user":
        return _Part(content_text(message.content))
    return _Part(_tool_result_text(message.content), is_tool_result=True, tool_call_id=message.tool_call_id or "")


def _tool_result_text(content: str | list[dict[str, Any]] | None) -> str:
    if not isinstance(content, list):
        return content or ""
    # V4 can only read text back; other parts are named so the model knows they existed.
    texts = [
        part.get("text", "") if part.get("type") == "text" else f"[Unsupported {part.get('type')}]" for part in content
    ]
    return "\n\n".join(texts)


def _sort_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Put each user turn's tool results in the order the assistant made the calls, since
    clients may send results in the order they finished."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {call["id"]: i for i, call in enumerate(turn.tool_calls) if call.get("id")}
        elif turn.role == "user" and call_order:
            results = [part for part in turn.parts if part.is_tool_result]
            ordered = iter(sorted(results, key=lambda part: call_order.get(part.tool_call_id, 0)))
            turn.parts = [next(ordered) if part.is_tool_result else part for part in turn.parts]
    return turns


def _render_assistant(turn: _Turn, shows_reasoning: bool) -> str:
    reasoning = turn.reasoning + THINK_END if shows_reasoning else ""
    calls = "\n\n" + render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
    return reasoning + turn.text + calls + EOS


def _render_invoke(function: dict[str, Any]) -> str:
    parameters = "\n".join(_render_parameter(name, value) for name, value in _arguments(function).items())
    return f'<{DSML_TOKEN}invoke name="{function.get("name", "")}">\n{parameters}\n</{DSML_TOKEN}invoke>'


def _render_parameter(name: str, value: Any) -> str:
    is_string = isinstance(value, str)
    text = value if is_string else _to_json(value)
    flag = "true" if is_string else "false"
    return f'<{DSML_TOKEN}parameter name="{name}" string="{flag}">{text}</{DSML_TOKEN}parameter>'


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    raw = arguments_json(function.get("arguments", "{}"))
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError:
        arguments = None
    # Arguments that are not a JSON object still reach the model, as one string parameter.
    return arguments if isinstance(arguments, dict) else {"arguments": raw}


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
