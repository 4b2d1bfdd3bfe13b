"""Claude Messages: the official anthropic SDK against one real node, and the adapter's
conversions (tool use and thinking) on hand-made chunk streams."""

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from exo.api.adapters.claude_messages import (
    ClaudeMessagesRequest,
    MessageEncoder,
    ThinkingConfig,
    to_task_params,
)
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated, PrefillProgress, ToolCall, Usage
from tests.support.node import TINY_MODEL_ID, ExoNode

HELLO = [{"role": "user", "content": "Hello there"}]
# This anthropic SDK has no sampling arguments any more; the API still takes them.
GREEDY = {"temperature": 0}


def client(node: ExoNode) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60)


def test_non_streaming_message_has_text_stop_reason_and_usage(node: ExoNode):
    message = client(node).messages.create(model=TINY_MODEL_ID, max_tokens=10, messages=HELLO, extra_body=GREEDY)
    assert message.role == "assistant" and message.type == "message" and message.model == TINY_MODEL_ID
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 10
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 10


def test_a_matched_stop_sequence_is_reported_as_such(node: ExoNode):
    sdk = client(node)
    whole = sdk.messages.create(model=TINY_MODEL_ID, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    text = whole.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    message = sdk.messages.create(
        model=TINY_MODEL_ID, max_tokens=12, messages=HELLO, stop_sequences=[stop], extra_body=GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_stream_events_come_in_order_and_concatenate_to_the_non_streaming_text(node: ExoNode):
    sdk = client(node)
    kwargs = dict(model=TINY_MODEL_ID, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    with sdk.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    raw = [
        k
        for k in kinds
        if k
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) == {"content_block_delta"}
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    whole = sdk.messages.create(**kwargs)
    assert streamed == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The second request reads the first's prompt from the prefix cache: Anthropic's
    # usage counts those tokens apart, so the prompt is the two parts together.
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage) > 0
    assert (whole.usage.cache_read_input_tokens or 0) > 0, whole.usage


def test_usage_equals_openai_chat_for_the_same_greedy_request(node: ExoNode):
    message = client(node).messages.create(model=TINY_MODEL_ID, max_tokens=8, messages=HELLO, extra_body=GREEDY)
    chat = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=TINY_MODEL_ID, messages=HELLO, max_tokens=8, temperature=0
    )
    assert message.content[0].text == chat.choices[0].message.content
    assert (prompt_tokens(message.usage), message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def prompt_tokens(usage) -> int:
    """The whole prompt: read fresh, read from the cache, written to it."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_system_prompt_as_blocks_and_a_stray_system_message_are_accepted(node: ExoNode):
    message = client(node).messages.create(
        model=TINY_MODEL_ID,
        max_tokens=4,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "system", "content": "Really brief."}, *HELLO],
    )
    assert message.usage.output_tokens > 0


def test_count_tokens_uses_the_model_tokenizer(node: ExoNode):
    short = client(node).messages.count_tokens(model=TINY_MODEL_ID, messages=HELLO)
    longer = client(node).messages.count_tokens(
        model=TINY_MODEL_ID, system="You are a helpful assistant.", messages=HELLO
    )
    assert 0 < short.input_tokens < longer.input_tokens


def test_bad_requests_are_4xx_in_anthropic_shape(node: ExoNode):
    response = node.post("/v1/messages", json={"model": TINY_MODEL_ID, "messages": HELLO})  # no max_tokens
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client(node).messages.create(model=TINY_MODEL_ID, max_tokens=4, messages=[])
    bad_json = node.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


def test_unknown_or_unplaced_model_is_a_404_in_anthropic_shape(node: ExoNode, tiny_models_dir: Path):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client(node).messages.create(model="nobody/nothing", max_tokens=4, messages=HELLO)
    assert raised.value.body["error"]["type"] == "not_found_error"
    assert "nobody/nothing" in raised.value.body["error"]["message"]


def test_client_leaving_mid_stream_cancels_the_task(node: ExoNode):
    body = {"model": TINY_MODEL_ID, "max_tokens": 100000, "messages": HELLO, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{node.url}/v1/messages", json=body, timeout=30) as response:
        lines = response.iter_lines()
        deltas = 0
        for line in lines:
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=20, what="the task dropped")


# The adapter alone: conversions the tiny random model cannot show.


def chunk(**fields) -> ChunkGenerated:
    return ChunkGenerated(command_id=CommandId("c"), **fields)


def test_request_blocks_become_chat_messages_tools_and_thinking():
    request = ClaudeMessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "sys",
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {}}}}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "stop_sequences": ["END"],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "use the tool", "signature": "s"},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "rain"}]},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
                    ],
                },
            ],
        }
    )
    params = to_task_params(request)
    roles = [m.role for m in params.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant, tool, user = params.messages[2:]
    assert assistant.reasoning_content == "use the tool"
    assert assistant.tool_calls == [
        {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    ]
    assert (tool.tool_call_id, tool.content) == ("t1", "rain")
    assert user.content == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]
    assert params.tools[0]["function"]["parameters"]["properties"] == {"city": {}}
    assert params.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert params.enable_thinking is True and params.stop == ["END"] and params.max_tokens == 5
    disabled = request.model_copy(update={"thinking": ThinkingConfig(type="disabled")})
    assert to_task_params(disabled).enable_thinking is False


def test_thinking_text_and_tool_use_chunks_become_blocks_in_order():
    encoder = MessageEncoder("msg_1", "m")
    chunks = [
        chunk(prefill=PrefillProgress(processed_tokens=7, total_tokens=7)),
        chunk(reasoning="Let me "),
        chunk(reasoning="think."),
        chunk(text="Calling."),
        chunk(
            tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
            finish_reason="tool_calls",
            usage=Usage(prompt_tokens=7, completion_tokens=9, cached_tokens=3),
        ),
    ]
    events = [event for c in chunks for event in encoder.feed(c)]
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        # The prefill progress: a ping, as Anthropic sends while it reads the prompt.
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 7
    assert events[3]["delta"] == {"type": "thinking_delta", "thinking": "Let me "}
    assert events[10]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}
    assert events[12]["delta"]["stop_reason"] == "tool_use"
    assert events[12]["usage"] == {
        "input_tokens": 7 - 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
        "output_tokens": 9,
    }
    body = encoder.body()
    assert body["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    # The SDK parses the whole body.
    parsed = anthropic.types.Message.model_validate(body)
    assert parsed.stop_reason == "tool_use" and parsed.content[2].input == {"city": "Oslo"}
    json.dumps(events)


def test_length_and_error_chunks():
    encoder = MessageEncoder("msg_2", "m")
    events = encoder.feed(chunk(text="a", finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)))
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    failing = MessageEncoder("msg_3", "m")
    events = failing.feed(chunk(finish_reason="error", error_message="runner died"))
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "runner died"}}
