"""DeepSeek V4 and V3.2 prompts, checked byte for byte against golden files.

Each case in tests/unit/data/encoding/<family>/ is a request (`<name>.json`: messages, tools,
thinking, reasoning_effort) and the exact prompt it must give (`<name>.txt`). The V4
prompts were produced by DeepSeek's own V4 encoder as upstream exo vendors it (after
upstream exo's message preparation); the V3.2 prompts by the encoder mlx-lm ships."""

import json
from pathlib import Path

import pytest

from exo.engine.encoding import deepseek_v4, deepseek_v32
from exo.engine.encoding.deepseek_v4 import ASSISTANT, BOS, EOS, REASONING_EFFORT_MAX, THINK_END, THINK_START, USER
from exo.shared.types.text_generation import ChatMessage

GOLDEN = Path(__file__).parent / "data" / "encoding"
ENCODERS = {"deepseek_v4": deepseek_v4.encode_messages, "deepseek_v32": deepseek_v32.encode_messages}
CASES = sorted((family, path.stem) for family in ENCODERS for path in (GOLDEN / family).glob("*.json"))


@pytest.mark.parametrize(("family", "name"), CASES, ids=[f"{family}/{name}" for family, name in CASES])
def test_prompt_matches_golden(family: str, name: str):
    case = json.loads((GOLDEN / family / f"{name}.json").read_text(encoding="utf-8"))
    expected = (GOLDEN / family / f"{name}.txt").read_text(encoding="utf-8")
    messages = [ChatMessage.model_validate(message) for message in case.pop("messages")]
    assert ENCODERS[family](messages, **case) == expected


def test_every_family_has_goldens():
    assert {family for family, _ in CASES} == set(ENCODERS)
    assert len(CASES) >= 25


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def assistant(text: str, reasoning: str | None = None, tool_calls: list[dict] | None = None) -> ChatMessage:
    return ChatMessage(role="assistant", content=text, reasoning_content=reasoning, tool_calls=tool_calls)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
EARLIER_TURN = [user("Hi"), assistant("<think>greet</think>Hello!", reasoning="greet"), user("Bye")]


def call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_v4_thinking_mode_opens_a_thinking_block():
    assert deepseek_v4.encode_messages([user("Hi")]) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_START}"


def test_v4_chat_mode_closes_the_thinking_block_at_once():
    assert deepseek_v4.encode_messages([user("Hi")], thinking=False) == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}"


@pytest.mark.parametrize(("effort", "prefixed"), [("xhigh", True), ("high", False), ("medium", False), (None, False)])
def test_v4_only_the_highest_effort_adds_the_max_prefix(effort: str | None, prefixed: bool):
    prompt = deepseek_v4.encode_messages([user("Hi")], reasoning_effort=effort)
    assert prompt.startswith(BOS + REASONING_EFFORT_MAX) is prefixed


def test_v4_effort_prefix_needs_thinking_mode():
    prompt = deepseek_v4.encode_messages([user("Hi")], thinking=False, reasoning_effort="xhigh")
    assert REASONING_EFFORT_MAX not in prompt


def test_v4_earlier_reasoning_and_think_blocks_are_dropped_without_tools():
    prompt = deepseek_v4.encode_messages(EARLIER_TURN)
    assert f"{ASSISTANT}{THINK_END}Hello!{EOS}" in prompt
    assert "greet" not in prompt


def test_v4_earlier_reasoning_is_kept_when_tools_are_offered():
    prompt = deepseek_v4.encode_messages(EARLIER_TURN, tools=[WEATHER])
    assert f"{ASSISTANT}{THINK_START}greet{THINK_END}Hello!{EOS}" in prompt
    assert prompt.count("greet") == 1


def test_v4_tools_get_a_system_message_when_there_is_none():
    prompt = deepseek_v4.encode_messages([user("Hi")], tools=[WEATHER])
    assert prompt.startswith(BOS + "\n\n## Tools\n")
    assert prompt.index('"get_weather"') < prompt.index(USER)


def test_v4_tool_results_join_one_user_turn_in_call_order():
    calls = [call("a", "Paris"), call("b", "Oslo")]
    messages = [
        user("Weather?"),
        assistant("", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="b", content="cold"),
        ChatMessage(role="tool", tool_call_id="a", content="warm"),
    ]
    prompt = deepseek_v4.encode_messages(messages, tools=[WEATHER])
    expected_end = f"{USER}<tool_result>warm</tool_result>\n\n<tool_result>cold</tool_result>{ASSISTANT}{THINK_START}"
    assert prompt.endswith(expected_end)
    assert prompt.count(USER) == 2


def test_v4_trailing_assistant_message_is_continued():
    prompt = deepseek_v4.encode_messages([user("Hi"), assistant("Hel")])
    assert prompt.endswith(f"{ASSISTANT}{THINK_START}Hel")


def test_v32_earlier_turn_drops_reasoning_and_echoed_think_blocks():
    prompt = deepseek_v32.encode_messages(EARLIER_TURN)
    assert prompt == f"{BOS}{USER}Hi{ASSISTANT}{THINK_END}Hello!{EOS}{USER}Bye{ASSISTANT}{THINK_START}"


def test_v32_tools_get_a_system_message_when_there_is_none():
    prompt = deepseek_v32.encode_messages([user("Hi")], tools=[WEATHER])
    assert prompt.startswith(BOS + "\n\n## Tools\n")
    assert "<｜DSML｜function_calls>" in prompt


def test_v32_tool_results_are_put_in_call_order():
    calls = [call("a", "Paris"), call("b", "Oslo")]
    messages = [
        user("Weather?"),
        assistant("", reasoning="two calls", tool_calls=calls),
        ChatMessage(role="tool", tool_call_id="b", content="cold"),
        ChatMessage(role="tool", tool_call_id="a", content="warm"),
    ]
    prompt = deepseek_v32.encode_messages(messages, tools=[WEATHER])
    assert prompt.endswith(
        "<function_results>\n<result>warm</result>\n<result>cold</result>\n</function_results>\n\n<think>"
    )
