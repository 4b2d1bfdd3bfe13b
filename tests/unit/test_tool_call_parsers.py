"""Tool calls come out of each family's output as ToolCalls with schema-typed arguments,
however the decoded pieces split the markers; text around them is kept; a call that
cannot be parsed becomes an error, never an exception."""

import json
from dataclasses import dataclass

import pytest

from exo.engine.parsing.base import Parsed
from exo.engine.parsing.output import make_output_parser, tool_format_for
from exo.engine.parsing.tool_calls import ToolCallParser, coerce_arguments, tool_call_format
from exo.shared.models.families import THINK_MARKERS


def function(name: str, **properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    function("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
    function("get_time", zone={"type": "string"}),
]
WEATHER = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {"zone": "CET"})


@dataclass(frozen=True)
class M:
    """A marker in a scripted output, which the test cuts into pieces."""

    text: str


def pieces(parts: list[str | M], how: str | int) -> list[str]:
    out: list[str] = []
    for part in parts:
        if not isinstance(part, M):
            out.append(part)
        elif how == "whole":
            out.append(part.text)
        elif how == "thirds":
            a, b = len(part.text) // 3, 2 * len(part.text) // 3
            out.extend(p for p in (part.text[:a], part.text[a:b], part.text[b:]) if p)
        else:
            cut = min(int(how), len(part.text) - 1)
            out.extend([part.text[:cut], part.text[cut:]])
    return out


def run(parser, chunks: list[str]) -> Parsed:
    total = Parsed()
    for chunk in chunks:
        total.extend(parser.feed(chunk))
    total.extend(parser.finish())
    return total


def calls(result: Parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in result.tool_calls]


# Realistic outputs per family: (format, parts, expected text, expected calls).
FAMILIES = {
    "hermes/Qwen": (
        "json",
        [
            "I'll check.\n\n",
            M("<tool_call>"),
            '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n',
            M("</tool_call>"),
            "\n",
            M("<tool_call>"),
            '\n{"name": "get_time", "arguments": {"zone": "CET"}}\n',
            M("</tool_call>"),
        ],
        "I'll check.\n\n\n",
        [WEATHER, TIME],
    ),
    "qwen3-coder": (
        "qwen3_coder",
        [
            M("<tool_call>"),
            "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n",
            M("</tool_call>"),
        ],
        "",
        [WEATHER],
    ),
    "GLM 4.7": (
        "glm47",
        [
            "Checking.",
            M("<tool_call>"),
            "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>3</arg_value>",
            M("</tool_call>"),
            M("<tool_call>"),
            "get_time<arg_key>zone</arg_key><arg_value>CET</arg_value>",
            M("</tool_call>"),
        ],
        "Checking.",
        [WEATHER, TIME],
    ),
    "MiniMax M2": (
        "minimax_m2",
        [
            "Let me look.\n",
            M("<minimax:tool_call>"),
            '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>\n'
            '<invoke name="get_time">\n<parameter name="zone">CET</parameter>\n</invoke>\n',
            M("</minimax:tool_call>"),
        ],
        "Let me look.\n",
        [WEATHER, TIME],
    ),
    "Kimi K2": (
        "kimi_k2",
        [
            "Sure.",
            M("<|tool_calls_section_begin|>"),
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
            '<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone": "CET"}'
            "<|tool_call_end|>",
            M("<|tool_calls_section_end|>"),
        ],
        "Sure.",
        [WEATHER, TIME],
    ),
    "Gemma 4": (
        "gemma4",
        [
            M("<|tool_call>"),
            'call:get_weather{city:<|"|>Paris<|"|>,days:3}',
            M("<tool_call|>"),
            M("<|tool_call>"),
            'call:get_time{zone:<|"|>CET<|"|>}',
            M("<tool_call|>"),
        ],
        "",
        [WEATHER, TIME],
    ),
    "pythonic": (
        "pythonic",
        [M("<|tool_call_start|>"), '[get_weather(city="Paris", days=3), get_time(zone="CET")]', M("<|tool_call_end|>")],
        "",
        [WEATHER, TIME],
    ),
    "Mistral": (
        "mistral",
        [
            M("[TOOL_CALLS]"),
            'get_weather[ARGS]{"city": "Paris", "days": 3}',
            M("[TOOL_CALLS]"),
            'get_time[ARGS]{"zone": "CET"}',
        ],
        "",
        [WEATHER, TIME],
    ),
}
SPLITS = ["whole", "thirds", *range(1, 28)]


@pytest.mark.parametrize("how", SPLITS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_output_split_any_way(family: str, how: str | int) -> None:
    tool_format, parts, text, expected = FAMILIES[family]
    result = run(ToolCallParser(tool_call_format(tool_format), TOOLS), pieces(parts, how))
    assert result.error is None
    assert result.text == text
    assert calls(result) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_family_output_character_by_character(family: str) -> None:
    tool_format, parts, text, expected = FAMILIES[family]
    output = "".join(part.text if isinstance(part, M) else part for part in parts)
    result = run(ToolCallParser(tool_call_format(tool_format), TOOLS), list(output))
    assert (result.text, calls(result), result.error) == (text, expected, None)


def test_text_before_between_and_after_calls_is_kept() -> None:
    output = (
        'A<tool_call>{"name": "get_time", "arguments": {}}</tool_call>B<tool_call>{"name": "get_time"}</tool_call>C'
    )
    result = run(ToolCallParser(tool_call_format("json"), TOOLS), [output])
    assert result.text == "ABC"
    assert [call.name for call in result.tool_calls] == ["get_time", "get_time"]


def test_each_call_gets_a_fresh_id() -> None:
    output = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    ids = [call.id for call in run(ToolCallParser(tool_call_format("json"), TOOLS), [output]).tool_calls]
    assert all(call_id.startswith("call_") for call_id in ids)
    assert len(set(ids)) == 2


def test_kimi_keeps_the_models_own_call_id() -> None:
    _, parts, _, _ = FAMILIES["Kimi K2"]
    result = run(ToolCallParser(tool_call_format("kimi_k2"), TOOLS), pieces(parts, "whole"))
    assert [call.id for call in result.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]


def test_partial_start_marker_at_the_end_is_flushed_as_text() -> None:
    result = run(ToolCallParser(tool_call_format("json"), TOOLS), ["see <tool_c"])
    assert result == Parsed(text="see <tool_c")


def test_unclosed_call_is_an_error_not_an_exception() -> None:
    result = run(ToolCallParser(tool_call_format("json"), TOOLS), ['Ok <tool_call>{"name": "get_weather", "argu'])
    assert result.text == "Ok "
    assert result.tool_calls == []
    assert result.error is not None and "</tool_call>" in result.error


def test_unparseable_body_is_an_error_and_later_text_still_arrives() -> None:
    result = run(ToolCallParser(tool_call_format("json"), TOOLS), ["<tool_call>{not json}</tool_call>after"])
    assert result.text == "after"
    assert result.error is not None and "json tool call" in result.error


def test_call_without_a_name_is_an_error() -> None:
    result = run(ToolCallParser(tool_call_format("json"), TOOLS), ['<tool_call>{"arguments": {}}</tool_call>'])
    assert result.error is not None and "name" in result.error


SCHEMA_TOOLS = [
    function(
        "f",
        n={"type": "integer"},
        x={"type": "number"},
        flag={"type": "boolean"},
        opts={"type": "object", "properties": {"depth": {"type": "integer"}}},
        tags={"type": "array", "items": {"type": "integer"}},
        label={"type": "string"},
        maybe={"anyOf": [{"type": "integer"}, {"type": "null"}]},
    )
]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"n": "5"}, {"n": 5}),
        ({"n": 5.0}, {"n": 5}),
        ({"x": "2.5"}, {"x": 2.5}),
        ({"flag": "true"}, {"flag": True}),
        ({"flag": "False"}, {"flag": False}),
        ({"opts": '{"depth": "2"}'}, {"opts": {"depth": 2}}),
        ({"tags": "[1, 2]"}, {"tags": [1, 2]}),
        ({"tags": ["1", "2"]}, {"tags": [1, 2]}),
        ({"label": 5}, {"label": "5"}),
        ({"label": "5"}, {"label": "5"}),
        ({"maybe": "null"}, {"maybe": None}),
        ({"maybe": "7"}, {"maybe": 7}),
        ({"n": "five"}, {"n": "five"}),
        ({"unknown": "5"}, {"unknown": "5"}),
    ],
)
def test_arguments_are_coerced_to_the_schema(given: dict, expected: dict) -> None:
    assert coerce_arguments("f", given, SCHEMA_TOOLS) == expected


def test_unknown_tool_arguments_pass_through() -> None:
    assert coerce_arguments("nope", {"n": "5"}, SCHEMA_TOOLS) == {"n": "5"}
    assert coerce_arguments("f", {"n": "5"}, None) == {"n": "5"}


def test_xml_family_arguments_follow_the_schema() -> None:
    output = (
        '<minimax:tool_call><invoke name="get_weather"><parameter name="days">4</parameter>'
        '<parameter name="metric">true</parameter><parameter name="city">10</parameter></invoke></minimax:tool_call>'
    )
    result = run(ToolCallParser(tool_call_format("minimax_m2"), TOOLS), [output])
    assert calls(result) == [("get_weather", {"days": 4, "metric": True, "city": "10"})]


# With thinking: realistic turns through make_output_parser, fed one character at a time.
THINKING_TURNS = {
    "Qwen3": (
        "json",
        "<think>",
        "<think>\nThe user wants the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n</tool_call>',
    ),
    "GLM 4.7": (
        "glm47",
        "<think>",
        "<think>The user wants the weather.</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    ),
    "MiniMax M2": (
        "minimax_m2",
        "<think>",
        "<think>\nThe user wants the weather.\n</think>\n\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
    ),
    "Kimi K2": (
        "kimi_k2",
        "<think>",
        "<think>The user wants the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
    ),
    "Gemma 4": (
        "gemma4",
        THINK_MARKERS["gemma4"][0],
        '<|channel>thought\nThe user wants the weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,'
        "days:3}<tool_call|>",
    ),
}


@pytest.mark.parametrize("turn", THINKING_TURNS)
def test_thinking_then_tool_call(turn: str) -> None:
    tool_format, start, output = THINKING_TURNS[turn]
    end = THINK_MARKERS["gemma4"][1] if tool_format == "gemma4" else "</think>"
    result = run(make_output_parser(tool_format, start, end, False, TOOLS), list(output))
    assert result.error is None
    assert result.reasoning.strip() == "The user wants the weather."
    assert result.text.strip() == ""
    assert calls(result) == [WEATHER]


def test_a_call_inside_reasoning_is_not_run() -> None:
    output = '<think>maybe <tool_call>{"name": "get_time"}</tool_call>?</think>No call needed.'
    result = run(make_output_parser("json", "<think>", "</think>", False, TOOLS), [output])
    assert result.tool_calls == []
    assert result.text == "No call needed."


def test_no_tool_format_and_no_markers_is_plain_text() -> None:
    assert run(make_output_parser(None, None, None, False, None), ["a<think>b"]) == Parsed(text="a<think>b")


def test_dsml_format_still_splits_thinking_off_first() -> None:
    result = run(make_output_parser("dsml", "<think>", "</think>", True, TOOLS), list("Hmm.</think>Hello."))
    assert (result.reasoning, result.text, result.error) == ("Hmm.", "Hello.", None)


def test_an_mlx_lm_module_name_is_a_format_too() -> None:
    output = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    assert calls(run(make_output_parser("json_tools", None, None, False, TOOLS), [output])) == [TIME]


HARMONY_TURN = [
    M("<|channel|>"),
    "analysis",
    M("<|message|>"),
    "User wants weather.",
    M("<|end|>"),
    M("<|start|>"),
    "assistant",
    M("<|channel|>"),
    "commentary to=functions.get_weather ",
    M("<|constrain|>"),
    "json",
    M("<|message|>"),
    '{"city":"Paris","days":"3"}',
    M("<|call|>"),
]


@pytest.mark.parametrize("how", SPLITS[:14])
def test_harmony_reasoning_and_tool_call(how: str | int) -> None:
    result = run(make_output_parser("harmony", None, None, False, TOOLS), pieces(HARMONY_TURN, how))
    assert (result.reasoning, result.text, result.error) == ("User wants weather.", "", None)
    assert calls(result) == [WEATHER]


def test_harmony_final_answer_streams_as_text() -> None:
    output = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    result = run(make_output_parser("harmony", None, None, False, None), list(output))
    assert result == Parsed(text="It is 4.", reasoning="Easy.")


def test_harmony_recipient_before_channel_and_call_token_not_fed() -> None:
    # <|call|> ends generation, so the engine may never feed it.
    output = (
        "<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}'
    )
    result = run(make_output_parser("harmony", None, None, False, TOOLS), [output])
    assert result.text == "Checking."
    assert calls(result) == [TIME]


def test_harmony_bad_arguments_are_an_error() -> None:
    output = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{zone<|call|>"
    result = run(make_output_parser("harmony", None, None, False, TOOLS), [output])
    assert result.tool_calls == []
    assert result.error is not None and "get_time" in result.error


def test_harmony_without_headers_is_plain_text() -> None:
    assert run(make_output_parser("harmony", None, None, False, None), ["Just ", "text."]) == Parsed(text="Just text.")


@pytest.mark.parametrize(
    ("model_type", "template", "expected"),
    [
        ("qwen3", "{% for tool_call in message.tool_calls %}<tool_call>\n{{ tool_call.name }}", "json"),
        ("qwen3_moe", "<tool_call>\n<function={{ tool_call.name }}>", "qwen3_coder"),
        ("glm4_moe", "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>", "glm47"),
        ("minimax_m2", "<minimax:tool_call>", "minimax_m2"),
        ("kimi_k2", "<|tool_calls_section_begin|>", "kimi_k2"),
        ("gemma4", "<|tool_call>call:{{ name }}<tool_call|>", "gemma4"),
        ("mistral3", "[TOOL_CALLS]", "mistral"),
        ("gpt_oss", None, "harmony"),
        ("deepseek_v32", None, "dsml"),
        ("glm4_moe", None, "glm47"),
        ("llama", "{{ messages }}", None),
    ],
)
def test_tool_format_for(model_type: str, template: str | None, expected: str | None) -> None:
    assert tool_format_for(model_type, template) == expected
