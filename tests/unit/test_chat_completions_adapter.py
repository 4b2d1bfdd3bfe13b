"""The Chat Completions adapter carries reasoning, tool calls and effort both ways, in the
shapes OpenAI's own SDK parses, without a node."""

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from exo.api.adapters.chat_completions import (
    ChatCompletionEncoder,
    ChatCompletionRequest,
    completion_body,
    to_task_params,
)
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated, PrefillProgress, ToolCall, Usage

COMMAND = CommandId("cmd-1")
WEATHER = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
TIME = ToolCall(id="call_2", name="get_time", arguments='{"tz": "CET"}')


def chunk(**fields) -> ChunkGenerated:
    return ChunkGenerated(command_id=COMMAND, **fields)


def finished(reason: str = "stop", **fields) -> ChunkGenerated:
    usage = Usage(prompt_tokens=10, completion_tokens=7, reasoning_tokens=4)
    return chunk(finish_reason=reason, usage=usage, **fields)


def stream(chunks: list[ChunkGenerated], include_usage: bool = True) -> list[str]:
    encoder = ChatCompletionEncoder("chatcmpl-1", "tiny/model", include_usage)
    return [encoder.wire(event) for c in chunks for event in encoder.feed(c)]


def data_events(lines: list[str]) -> list[ChatCompletionChunk]:
    return [ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in lines if line.startswith("data: ")]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny/model", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


# Requests


def test_reasoning_effort_and_tool_choice_reach_the_task_params():
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    params = to_task_params(request(reasoning_effort="high", tool_choice=tool_choice))
    assert params.reasoning_effort == "high"
    assert params.tool_choice == tool_choice
    assert params.enable_thinking is True


def test_effort_none_turns_thinking_off_unless_enable_thinking_says_otherwise():
    assert to_task_params(request(reasoning_effort="none")).enable_thinking is False
    assert to_task_params(request(reasoning_effort="none", enable_thinking=True)).enable_thinking is True
    assert to_task_params(request()).enable_thinking is None


def test_unknown_reasoning_effort_is_rejected():
    with pytest.raises(ValidationError):
        request(reasoning_effort="ludicrous")


def test_assistant_reasoning_and_tool_calls_and_tool_results_come_back_into_the_conversation():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assistant, tool = to_task_params(request(messages=messages)).messages[1:]
    assert assistant.reasoning_content == "I should look."
    assert assistant.tool_calls == [call]
    assert tool.tool_call_id == "call_1"


def test_multimodal_assistant_message_keeps_its_reasoning():
    parts = [{"type": "text", "text": "It is a cat."}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}]},
        {"role": "assistant", "content": parts, "reasoning_content": "Whiskers, so a cat."},
        {"role": "user", "content": "sure?"},
    ]
    assistant = to_task_params(request(messages=messages)).messages[1]
    assert assistant.content == parts
    assert assistant.reasoning_content == "Whiskers, so a cat."


def test_reasoning_sent_back_under_openrouters_name_is_accepted():
    messages = [{"role": "assistant", "content": "4", "reasoning": "2+2"}, {"role": "user", "content": "and 3+3?"}]
    assert to_task_params(request(messages=messages)).messages[0].reasoning_content == "2+2"


# Streaming


def test_stream_carries_reasoning_then_content():
    lines = stream([chunk(reasoning="Let me "), chunk(reasoning="think."), chunk(text="Hi"), finished()])
    events = data_events(lines)
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert deltas[0].role == "assistant"
    assert [json.loads(line[6:])["choices"][0]["delta"].get("reasoning_content") for line in lines[:2]] == [
        "Let me ",
        "think.",
    ]
    assert "".join(d.content or "" for d in deltas) == "Hi"
    assert events[-1].usage is not None
    assert events[-1].usage.completion_tokens_details.reasoning_tokens == 4


def test_streamed_tool_calls_are_indexed_across_the_whole_response():
    lines = stream([chunk(tool_calls=[WEATHER]), chunk(tool_calls=[TIME]), finished("tool_calls")])
    events = data_events(lines)
    calls = [call for e in events if e.choices for call in e.choices[0].delta.tool_calls or []]
    assert [(c.index, c.id, c.type, c.function.name, c.function.arguments) for c in calls] == [
        (0, "call_1", "function", "get_weather", '{"city": "Paris"}'),
        (1, "call_2", "function", "get_time", '{"tz": "CET"}'),
    ]
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"


def test_several_tool_calls_in_one_chunk_get_consecutive_indexes():
    events = data_events(stream([chunk(tool_calls=[WEATHER, TIME]), finished("tool_calls")]))
    assert [c.index for c in events[0].choices[0].delta.tool_calls] == [0, 1]


def test_prefill_progress_is_an_sse_comment_and_not_a_chunk():
    lines = stream(
        [chunk(prefill=PrefillProgress(processed_tokens=120, total_tokens=512)), chunk(text="Hi"), finished()]
    )
    assert lines[0] == ": prefill 120/512\n\n"
    first = data_events(lines)[0]
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == "Hi"


def test_error_mid_stream_is_still_an_error_event():
    lines = stream([chunk(text="Hi"), chunk(finish_reason="error", error_message="runner died")])
    assert json.loads(lines[-1][6:])["error"]["message"] == "runner died"


# Non-streaming


def test_body_has_reasoning_content_and_answer():
    body = completion_body("chatcmpl-1", "tiny/model", [chunk(reasoning="Hmm."), chunk(text="Hi"), finished()])
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content == "Hi"
    assert body["choices"][0]["message"]["reasoning_content"] == "Hmm."
    assert message.tool_calls is None
    assert body["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": 4,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }


def test_body_without_reasoning_has_no_reasoning_content():
    body = completion_body("chatcmpl-1", "tiny/model", [chunk(text="Hi"), finished()])
    assert "reasoning_content" not in body["choices"][0]["message"]


def test_body_with_only_tool_calls_has_null_content():
    chunks = [chunk(reasoning="Need weather and time."), chunk(tool_calls=[WEATHER, TIME]), finished("tool_calls")]
    body = completion_body("chatcmpl-1", "tiny/model", chunks)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("call_1", "function", "get_weather", '{"city": "Paris"}'),
        ("call_2", "function", "get_time", '{"tz": "CET"}'),
    ]


def test_body_with_text_and_tool_calls_keeps_the_text():
    chunks = [chunk(text="Checking."), chunk(tool_calls=[WEATHER]), finished("tool_calls")]
    message = ChatCompletion.model_validate(completion_body("chatcmpl-1", "tiny/model", chunks)).choices[0].message
    assert message.content == "Checking."
    assert len(message.tool_calls) == 1


def test_prefill_chunks_add_nothing_to_the_body():
    chunks = [chunk(prefill=PrefillProgress(processed_tokens=5, total_tokens=5)), chunk(text="Hi"), finished()]
    message = completion_body("chatcmpl-1", "tiny/model", chunks)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hi"}
