"""Tool calls in a model's answer, for the families whose calls sit between a start and an
end marker in the text: hermes JSON (Qwen), qwen3-coder XML, GLM 4.7, MiniMax M2, Kimi K2,
Gemma 4, pythonic (LFM2) and Mistral.

mlx-lm already parses a complete call body for each of these (`mlx_lm.tool_parsers.*`);
this module adds what a stream needs: finding the markers however the pieces split them,
buffering a call until it closes, and turning mlx-lm's dicts into ToolCalls whose
arguments match the tool's JSON schema."""

import importlib
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exo.engine.parsing.base import Parsed, held_suffix_length
from exo.shared.types.text_generation import ToolCall

BodyParser = Callable[[str, list[dict[str, Any]] | None], Any]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str
    # "" when the format has no end marker (Mistral): the call runs to the end of output.
    end: str
    parse_body: BodyParser


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _mlx_parser(module_name: str) -> ToolCallFormat:
    # Imported on first use: mlx_lm pulls in mlx, which a process that never parses
    # tool calls need not load.
    module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
    return ToolCallFormat(module_name, module.tool_call_start, module.tool_call_end, module.parse_tool_call)


def _parse_json_body(body: str, tools: list[dict[str, Any]] | None) -> Any:
    # Hermes bodies are one JSON object, or now and then a list of them.
    return json.loads(body.strip())


def _parse_qwen3_coder_body(body: str, tools: list[dict[str, Any]] | None) -> Any:
    # Qwen3 coder models sometimes fall back to hermes JSON inside the same markers.
    if body.strip().startswith("{"):
        return _parse_json_body(body, tools)
    return _mlx_parser("qwen3_coder").parse_body(body, tools)


def _parse_mistral_body(body: str, tools: list[dict[str, Any]] | None) -> Any:
    # Mistral has no end marker, so a later call in the same turn repeats the start marker
    # inside what we buffered.
    return _mlx_parser("mistral").parse_body(body.replace("[TOOL_CALLS]", "").strip(), tools)


# Our format names, as make_output_parser takes them, to the mlx-lm module they use.
MLX_MODULES = {
    "json": "json_tools",
    "qwen3_coder": "qwen3_coder",
    "glm47": "glm47",
    "minimax_m2": "minimax_m2",
    "kimi_k2": "kimi_k2",
    "gemma4": "gemma4",
    "pythonic": "pythonic",
    "mistral": "mistral",
}

_BODY_OVERRIDES: dict[str, BodyParser] = {
    "json": _parse_json_body,
    "qwen3_coder": _parse_qwen3_coder_body,
    "mistral": _parse_mistral_body,
}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format for one of our names, or for any other mlx-lm tool parser module name
    (function_gemma, longcat, ...) so newer mlx-lm parsers work without code here."""
    mlx = _mlx_parser(MLX_MODULES.get(name, name))
    return ToolCallFormat(name, mlx.start, mlx.end, _BODY_OVERRIDES.get(name, mlx.parse_body))


def coerce_arguments(tool_name: str, arguments: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Bring argument values to the types the tool's schema declares. Models write "5" for
    an integer or a JSON string for an object often enough (and the XML formats can only
    write text), so clients get what their schema promised. Unknown tools or properties
    pass through unchanged."""
    schema = _tool_parameters(tool_name, tools)
    return _coerce(arguments, schema) if schema else arguments


def _tool_parameters(tool_name: str, tools: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == tool_name:
            return function.get("parameters") or None
    return None


def _schema_types(schema: dict[str, Any]) -> list[str]:
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    for choice in ("anyOf", "oneOf"):
        for option in schema.get(choice) or []:
            if isinstance(option, dict):
                types.extend(_schema_types(option))
    return types


def _coerce(value: Any, schema: Any) -> Any:
    if not isinstance(schema, dict):
        return value
    types = _schema_types(schema)
    if isinstance(value, str) and "string" not in types:
        value = _from_text(value, types)
    elif types == ["string"] and not isinstance(value, str):
        # The model wrote 5 where the schema wants "5".
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
        return int(value)
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        return {key: _coerce(item, schema["properties"].get(key)) for key, item in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_coerce(item, schema["items"]) for item in value]
    return value


def _from_text(text: str, types: list[str]) -> Any:
    """The first declared type the text reads as; the text itself if none fits."""
    stripped = text.strip()
    for kind in types:
        try:
            if kind == "integer":
                number = float(stripped)
                if number.is_integer():
                    return int(number)
            elif kind == "number":
                number = float(stripped)
                return int(number) if number.is_integer() and "." not in stripped else number
            elif kind == "boolean" and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            elif kind == "null" and stripped.lower() in ("null", "none"):
                return None
            elif kind in ("object", "array"):
                parsed = json.loads(stripped)
                if isinstance(parsed, dict if kind == "object" else list):
                    return parsed
        except ValueError:  # json.JSONDecodeError is a ValueError too
            continue
    return text


def to_tool_calls(parsed: Any, tools: list[dict[str, Any]] | None) -> list[ToolCall]:
    """mlx-lm parsers return a dict or a list of dicts with name and arguments (and an id
    for Kimi and some Mistral outputs, which we keep: their templates replay it)."""
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise ValueError("no tool call in the body")
    return [_to_tool_call(item, tools) for item in items]


def _to_tool_call(item: Any, tools: list[dict[str, Any]] | None) -> ToolCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        raise ValueError(f"a tool call needs a name, got {item!r}")
    # Some hermes-style models write "parameters" instead of "arguments".
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be an object, got {arguments!r}")
    arguments = coerce_arguments(item["name"], arguments, tools)
    given_id = item.get("id")
    call_id = given_id if isinstance(given_id, str) and given_id else new_call_id()
    return ToolCall(id=call_id, name=item["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Streams text through, cutting out each marked tool call and parsing it once closed.

    Parse failures do not raise: the turn carries `Parsed.error` and goes on, so text the
    model wrote after a bad call is still delivered."""

    def __init__(self, call_format: ToolCallFormat, tools: list[dict[str, Any]] | None = None) -> None:
        self.format = call_format
        self.tools = tools
        self.in_call = False
        self.held = ""

    def feed(self, piece: str) -> Parsed:
        out = Parsed()
        buffer = self.held + piece
        start, end = self.format.start, self.format.end
        while True:
            marker = end if self.in_call else start
            index = buffer.find(marker) if marker else -1
            if index < 0:
                break
            if self.in_call:
                self._complete(out, buffer[:index])
            else:
                out.text += buffer[:index]
            buffer = buffer[index + len(marker) :]
            self.in_call = not self.in_call
        if self.in_call:
            # A call body is never shown: all of it waits for the end marker.
            self.held = buffer
        else:
            keep = held_suffix_length(buffer, [start])
            out.text += buffer[: len(buffer) - keep]
            self.held = buffer[len(buffer) - keep :]
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if not self.in_call:
            out.text = self.held
        elif not self.format.end:
            self._complete(out, self.held)
        else:
            out.error = (
                f"the output ended inside a {self.format.name} tool call "
                f"(no {self.format.end!r} after {self.format.start!r}): {self.held[:200]!r}"
            )
        self.held = ""
        self.in_call = False
        return out

    def _complete(self, out: Parsed, body: str) -> None:
        try:
            out.tool_calls.extend(to_tool_calls(self.format.parse_body(body, self.tools), self.tools))
        except Exception as exc:  # mlx-lm parsers raise anything from ValueError to KeyError
            out.error = out.error or f"could not parse a {self.format.name} tool call {body[:200]!r}: {exc}"
