"""Each reasoning dialect keeps, drops or folds back assistant reasoning the way its
model family's template expects when a conversation comes back."""

import pytest

from exo.engine.reasoning_dialect import apply_reasoning_dialect, template_fields
from exo.shared.models.model_cards import ReasoningDialect
from exo.shared.types.text_generation import ChatMessage

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def assistant(text: str | None, reasoning: str | None, **fields) -> ChatMessage:
    return ChatMessage(role="assistant", content=text, reasoning_content=reasoning, **fields)


# Two finished turns, then a turn still being worked on after the last user message.
CHAT = [
    ChatMessage(role="system", content="Be brief."),
    user("2+2?"),
    assistant("4", "Add them."),
    user("3+3?"),
    assistant("6", "Add again."),
]
OLD, RECENT = 2, 4
TOOL_CHAT = [
    user("weather in Paris?"),
    assistant(None, "I should look it up.", tool_calls=[CALL]),
    ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    assistant("Sunny.", "The tool said sunny."),
    user("and tomorrow?"),
]


def reasonings(messages: list[ChatMessage]) -> list[str | None]:
    return [m.reasoning_content for m in messages]


def test_post_last_user_drops_reasoning_before_the_last_user_message():
    chat = [*CHAT, user("5+5?"), assistant("10", "Once more.")]
    out = apply_reasoning_dialect(chat, "post_last_user", tools_in_play=False)
    assert reasonings(out) == [None, None, None, None, None, None, "Once more."]
    assert [m.content for m in out] == [m.content for m in chat]


def test_post_last_user_drops_all_when_the_conversation_ends_with_a_user_message():
    out = apply_reasoning_dialect([*CHAT, user("5+5?")], ReasoningDialect.post_last_user, tools_in_play=False)
    assert all(m.reasoning_content is None for m in out)


def test_post_last_user_keeps_reasoning_across_tool_results_after_the_last_user_message():
    out = apply_reasoning_dialect(TOOL_CHAT[:4], "post_last_user", tools_in_play=True)
    assert reasonings(out) == [None, "I should look it up.", None, "The tool said sunny."]


def test_tool_conditional_keeps_every_reasoning_when_the_request_has_tools():
    out = apply_reasoning_dialect([*CHAT, user("5+5?")], "tool_conditional", tools_in_play=True)
    assert out[OLD].reasoning_content == "Add them."
    assert out[RECENT].reasoning_content == "Add again."


def test_tool_conditional_keeps_every_reasoning_when_the_conversation_used_tools():
    out = apply_reasoning_dialect(TOOL_CHAT, "tool_conditional", tools_in_play=False)
    assert reasonings(out) == reasonings(TOOL_CHAT)


def test_tool_conditional_without_tools_is_post_last_user():
    chat = [*CHAT, user("5+5?"), assistant("10", "Once more.")]
    assert apply_reasoning_dialect(chat, "tool_conditional", tools_in_play=False) == apply_reasoning_dialect(
        chat, "post_last_user", tools_in_play=False
    )


def test_channel_keeps_reasoning_as_is_and_hands_it_to_the_template_as_thinking():
    out = apply_reasoning_dialect(CHAT, "channel", tools_in_play=False)
    assert out == CHAT
    assert template_fields(out[OLD], "channel") == {"thinking": "Add them."}


def test_other_dialects_hand_the_template_reasoning_content():
    assert template_fields(CHAT[RECENT], "post_last_user") == {"reasoning_content": "Add again."}
    assert template_fields(CHAT[1], "channel") == {}


def test_suffix_leaves_content_and_reasoning_as_they_came():
    assert apply_reasoning_dialect(CHAT, "suffix", tools_in_play=False) == CHAT
    assert apply_reasoning_dialect(TOOL_CHAT, "suffix", tools_in_play=True) == TOOL_CHAT


@pytest.mark.parametrize("tools_in_play", [False, True])
def test_none_drops_every_reasoning(tools_in_play: bool):
    out = apply_reasoning_dialect(TOOL_CHAT, "none", tools_in_play=tools_in_play)
    assert all(m.reasoning_content is None for m in out)
    assert [m.content for m in out] == [m.content for m in TOOL_CHAT]


def test_unknown_dialect_is_an_error():
    with pytest.raises(ValueError):
        apply_reasoning_dialect(CHAT, "telepathy", tools_in_play=False)
