"""DeepSeek's DSML tool calls, parsed out of the streamed answer.

DeepSeek V3.2 and V4 call tools by writing a block after their answer:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V3.2 names the outer block `function_calls`; the rest is the same, so one parser serves
both. A parameter's value is raw text when `string="true"` and JSON otherwise. Markers
arrive split over many decoded pieces (the V4 tokenizer writes `<｜DSML｜tool_calls>` as
six tokens), so text that may still become a marker is held back until it is decided.

Reasoning is split off before this parser runs: it sees only the answer."""

import json
import re
from typing import Any
from uuid import uuid4

from exo.engine.encoding.deepseek_v4 import DSML_TOKEN
from exo.engine.parsing.base import Parsed
from exo.shared.types.text_generation import ToolCall

# Opening marker -> its closing marker, for V4's and V3.2's block names.
BLOCKS = {f"<{DSML_TOKEN}{name}>": f"</{DSML_TOKEN}{name}>" for name in ("tool_calls", "function_calls")}

_D = re.escape(DSML_TOKEN)
_INVOKE = re.compile(rf'\s*<{_D}invoke\s+name="([^"]*)"\s*>(.*?)</{_D}invoke>\s*', re.DOTALL)
_PARAMETER = re.compile(
    rf'\s*<{_D}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{_D}parameter>\s*', re.DOTALL
)
_NOT_JSON = object()
# How much of a bad block an error message quotes.
_QUOTE_LIMIT = 500


class MalformedBlock(ValueError):
    pass


class DsmlParser:
    """Turns DSML blocks into ToolCalls and passes the text around them through.

    `tools` (OpenAI format) lets a parameter get its schema's type when the model set the
    `string` flag wrongly, say a number written with `string="true"`."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.parameter_types = parameter_types(tools or [])
        # Outside a block: text not yet shown. Inside: the block so far, opening marker included.
        self.held = ""
        # The opening marker of the block we are inside, if any.
        self.opener: str | None = None

    def feed(self, piece: str) -> Parsed:
        out = Parsed()
        self.held += piece
        while self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self.opener is not None:
            out.error = f"unclosed DSML tool-call block: {_quote(self.held)}"
        else:
            # What was held (a partial marker, trailing whitespace) turned out to be text.
            out.text = self.held
        self.held = ""
        self.opener = None
        return out

    def _step(self, out: Parsed) -> bool:
        """Take one decision on the held text; True while there may be another to take."""
        if self.opener is None:
            return self._scan_text(out)
        closer = BLOCKS[self.opener]
        end = self.held.find(closer)
        if end < 0:
            return False
        block, self.held = self.held[: end + len(closer)], self.held[end + len(closer) :]
        self._emit_block(out, block, body=block[len(self.opener) : end])
        self.opener = None
        return True

    def _scan_text(self, out: Parsed) -> bool:
        found = _first_opener(self.held)
        if found is None:
            keep = _partial_marker_length(self.held, list(BLOCKS))
            # Whitespace just before a block separates it from the answer and is not part
            # of the answer, so it waits until the next text shows whether a block follows.
            shown = self.held[: len(self.held) - keep].rstrip()
            out.text += shown
            self.held = self.held[len(shown) :]
            return False
        index, opener = found
        out.text += self.held[:index].rstrip()
        self.held = self.held[index:]
        self.opener = opener
        return True

    def _emit_block(self, out: Parsed, block: str, body: str) -> None:
        try:
            out.tool_calls.extend(self._tool_calls(body))
        except MalformedBlock as problem:
            out.error = out.error or f"malformed DSML tool-call block ({problem}): {_quote(block)}"

    def _tool_calls(self, body: str) -> list[ToolCall]:
        calls = [
            ToolCall(id=f"call_{uuid4().hex}", name=name, arguments=self._arguments_json(name, parameters))
            for name, parameters in _matches(_INVOKE, body, "invoke")
        ]
        if not calls:
            raise MalformedBlock("no invoke")
        return calls

    def _arguments_json(self, tool_name: str, parameters: str) -> str:
        types = self.parameter_types.get(tool_name, {})
        arguments: dict[str, Any] = {}
        for name, flag, raw in _matches(_PARAMETER, parameters, "parameter"):
            if name in arguments:
                raise MalformedBlock(f"parameter {name!r} given twice")
            arguments[name] = typed_value(raw, flag == "true", types.get(name, set()))
        return json.dumps(arguments, ensure_ascii=False)


def typed_value(raw: str, string_flag: bool, declared: set[str]) -> Any:
    """A parameter's value. The flag decides, unless the schema disagrees: a value the
    schema says is not a string is read as JSON, one it says is a string stays text."""
    if string_flag and (not declared or "string" in declared):
        return raw
    value = _json_or(raw, _NOT_JSON)
    if value is _NOT_JSON:
        # Not JSON after all: the text is the best reading of it.
        return raw
    if declared and not _json_type_in(value, declared) and (string_flag or "string" in declared):
        return raw
    return value


def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, set[str]]]:
    """Tool name -> parameter name -> the JSON types its schema allows (empty if unknown)."""
    table: dict[str, dict[str, set[str]]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        table[function.get("name", "")] = {name: _schema_types(schema) for name, schema in properties.items()}
    return table


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {name for name in declared if isinstance(name, str)}
    alternatives = schema.get("anyOf") or schema.get("oneOf") or []
    return set().union(*(_schema_types(alternative) for alternative in alternatives))


def _json_type_in(value: Any, declared: set[str]) -> bool:
    if isinstance(value, bool):
        names = {"boolean"}
    elif isinstance(value, int):
        names = {"integer", "number"}
    elif isinstance(value, float):
        names = {"number"}
    elif isinstance(value, str):
        names = {"string"}
    elif isinstance(value, list):
        names = {"array"}
    elif isinstance(value, dict):
        names = {"object"}
    else:
        names = {"null"}
    return bool(names & declared)


def _json_or(raw: str, default: Any) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return default


def _matches(pattern: re.Pattern[str], text: str, what: str) -> list[tuple[str, ...]]:
    """Every match of pattern, which must cover the text with nothing in between."""
    found: list[tuple[str, ...]] = []
    position = 0
    while position < len(text) and text[position:].strip():
        match = pattern.match(text, position)
        if match is None:
            raise MalformedBlock(f"expected {what} at {_quote(text[position:])}")
        found.append(match.groups())
        position = match.end()
    return found


def _first_opener(text: str) -> tuple[int, str] | None:
    hits = [(text.find(marker), marker) for marker in BLOCKS if marker in text]
    return min(hits) if hits else None


def _partial_marker_length(text: str, markers: list[str]) -> int:
    """How many trailing characters of text could be the start of a marker."""
    for length in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0


def _quote(text: str) -> str:
    return repr(text if len(text) <= _QUOTE_LIMIT else text[:_QUOTE_LIMIT] + "...")
