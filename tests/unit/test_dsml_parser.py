"""The DSML tool-call parser: DeepSeek V3.2 and V4 tool calls out of a streamed answer."""

import json

import pytest

from exo.engine.encoding.deepseek_v4 import DSML_TOKEN as D
from exo.engine.encoding.deepseek_v4 import render_tool_calls
from exo.engine.parsing.base import Parsed
from exo.engine.parsing.dsml import DsmlParser

# V4 output as its tokenizer splits it: `<｜DSML｜tool_calls>` alone is six pieces.
V4_READ_CALL_TOKENS = [
    "<", D, "tool", "_c", "alls", ">",
    "\n<", D, "invoke", ' name="read"',
    ">\n<", D, "parameter", ' name="filePath" string="true"', ">",
    "/Users/l2/PycharmProjects/exo",
    "</", D, "parameter",
    ">\n</", D, "invoke",
    ">\n</", D, "tool", "_c", "alls", ">",
]  # fmt: skip

WEATHER_BLOCK = (
    f"<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f"</{D}invoke>\n"
    f"</{D}tool_calls>"
)
ANSWER_WITH_CALL = "Let me check the weather.\n\n" + WEATHER_BLOCK + "Done."


def run(pieces: list[str], tools: list[dict] | None = None) -> Parsed:
    parser = DsmlParser(tools)
    total = Parsed()
    for piece in pieces:
        total.extend(parser.feed(piece))
    total.extend(parser.finish())
    return total


def arguments(parsed: Parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def test_v4_tool_call_split_over_many_tokens_becomes_one_tool_call():
    parsed = run(V4_READ_CALL_TOKENS)
    assert arguments(parsed) == [("read", {"filePath": "/Users/l2/PycharmProjects/exo"})]
    assert parsed.text == ""
    assert parsed.error is None


def test_v4_tool_call_after_thinking_is_parsed_from_the_content_alone():
    # The reasoning parser has already taken "<think>...</think>"; what follows reaches us.
    parsed = run(V4_READ_CALL_TOKENS)
    assert [call.name for call in parsed.tool_calls] == ["read"]
    assert D not in parsed.text


def test_no_marker_text_is_shown_while_a_block_arrives():
    parser = DsmlParser()
    shown = "".join(parser.feed(piece).text for piece in V4_READ_CALL_TOKENS)
    assert shown == ""


def test_text_before_and_after_the_block_is_kept():
    parsed = run([ANSWER_WITH_CALL])
    assert parsed.text == "Let me check the weather.Done."
    assert arguments(parsed) == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("cut", range(1, len(ANSWER_WITH_CALL)))
def test_a_split_at_any_point_gives_the_same_result(cut: int):
    parsed = run([ANSWER_WITH_CALL[:cut], ANSWER_WITH_CALL[cut:]])
    assert parsed.text == "Let me check the weather.Done."
    assert arguments(parsed) == [("get_weather", {"city": "Paris", "days": 3})]


def test_one_character_at_a_time_gives_the_same_result():
    parsed = run(list(ANSWER_WITH_CALL))
    assert parsed.text == "Let me check the weather.Done."
    assert arguments(parsed) == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize("cut", range(1, len(f"<{D}tool_calls>")))
def test_a_partial_marker_is_held_back_and_not_shown(cut: int):
    parser = DsmlParser()
    shown = parser.feed("Answer " + f"<{D}tool_calls>"[:cut]).text
    assert shown == "Answer"


def test_a_held_prefix_that_is_not_a_marker_is_shown_when_the_text_moves_on():
    parser = DsmlParser()
    shown = parser.feed(f"a <{D}tool").text
    shown += parser.feed("box> b").text
    assert shown == f"a <{D}toolbox> b"


def test_output_ending_inside_a_partial_marker_loses_nothing():
    parsed = run(["x < y ", f"<{D}tool_ca"])
    assert parsed.text == f"x < y <{D}tool_ca"
    assert parsed.error is None


def test_trailing_whitespace_is_kept_when_no_block_follows():
    assert run(["Hello", "\n\n"]).text == "Hello\n\n"
    assert run(["Hello\n\n", "world"]).text == "Hello\n\nworld"


def test_v32_function_calls_block_is_parsed():
    block = WEATHER_BLOCK.replace("tool_calls>", "function_calls>")
    parsed = run([block])
    assert arguments(parsed) == [("get_weather", {"city": "Paris", "days": 3})]


def test_several_invokes_give_several_calls_with_distinct_ids():
    calls = [
        {"id": "1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "b", "arguments": '{"y": "two"}'}},
    ]
    parsed = run([render_tool_calls(calls)])
    assert arguments(parsed) == [("a", {"x": 1}), ("b", {"y": "two"})]
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_two_blocks_in_one_answer_are_both_parsed():
    parsed = run([WEATHER_BLOCK, " and ", WEATHER_BLOCK])
    assert len(parsed.tool_calls) == 2
    assert parsed.text == " and"


def test_encoded_tool_calls_parse_back_to_the_same_arguments():
    original = {"query": "multi\nline <b>text</b>", "n": 2.5, "flags": [True, None], "opts": {"deep": "東京"}}
    calls = [{"id": "c", "type": "function", "function": {"name": "search", "arguments": json.dumps(original)}}]
    parsed = run(["Searching.\n\n" + render_tool_calls(calls)])
    assert parsed.text == "Searching."
    assert arguments(parsed) == [("search", original)]


def test_a_tool_without_parameters_gets_an_empty_object():
    parsed = run([f'<{D}tool_calls>\n<{D}invoke name="now">\n\n</{D}invoke>\n</{D}tool_calls>'])
    assert arguments(parsed) == [("now", {})]


def block_with(parameters: str) -> str:
    return f'<{D}tool_calls>\n<{D}invoke name="f">\n{parameters}\n</{D}invoke>\n</{D}tool_calls>'


def parameter(name: str, flag: str, value: str) -> str:
    return f'<{D}parameter name="{name}" string="{flag}">{value}</{D}parameter>'


F_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "count": {"type": "integer"},
                    "zip": {"type": "string"},
                    "maybe": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                },
            },
        },
    }
]


def test_the_schema_corrects_a_number_flagged_as_string():
    parsed = run([block_with(parameter("count", "true", "7"))], tools=F_TOOL)
    assert arguments(parsed) == [("f", {"count": 7})]


def test_the_schema_keeps_a_string_flagged_as_json_as_text():
    parsed = run([block_with(parameter("zip", "false", "02139"))], tools=F_TOOL)
    assert arguments(parsed) == [("f", {"zip": "02139"})]


def test_the_schema_allows_any_of_its_alternatives():
    parsed = run([block_with(parameter("maybe", "true", "null"))], tools=F_TOOL)
    assert arguments(parsed) == [("f", {"maybe": None})]


def test_without_a_schema_the_flag_decides():
    parsed = run([block_with(parameter("count", "true", "7") + "\n" + parameter("on", "false", "true"))])
    assert arguments(parsed) == [("f", {"count": "7", "on": True})]


def test_a_value_flagged_as_json_that_is_not_json_stays_text():
    parsed = run([block_with(parameter("note", "false", "not json"))])
    assert arguments(parsed) == [("f", {"note": "not json"})]


def test_an_unclosed_block_is_an_error_at_finish():
    parser = DsmlParser()
    fed = Parsed()
    for piece in V4_READ_CALL_TOKENS[:-6]:
        fed.extend(parser.feed(piece))
    assert fed.error is None
    finished = parser.finish()
    assert finished.error is not None and "unclosed" in finished.error
    assert fed.text == finished.text == ""
    assert fed.tool_calls == finished.tool_calls == []


@pytest.mark.parametrize(
    "body",
    [
        "\n\n",  # no invoke at all
        f'\nstray text<{D}invoke name="f">\n</{D}invoke>\n',
        f'\n<{D}invoke name="f">\n{parameter("a", "maybe", "1")}\n</{D}invoke>\n',
        f'\n<{D}invoke name="f">\n{parameter("a", "true", "1")}\n{parameter("a", "true", "2")}\n</{D}invoke>\n',
        f'\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1\n</{D}invoke>\n',
    ],
    ids=["empty", "stray-text", "bad-flag", "duplicate-parameter", "unclosed-parameter"],
)
def test_a_malformed_block_is_an_error_not_an_exception(body: str):
    parsed = run([f"Hi <{D}tool_calls>{body}</{D}tool_calls> bye"])
    assert parsed.error is not None and "malformed" in parsed.error
    assert parsed.tool_calls == []
    assert parsed.text == "Hi bye"
