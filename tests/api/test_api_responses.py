"""OpenAI Responses: the official openai SDK against one real node, and the adapter's
conversions (function calls and reasoning) on hand-made chunk streams."""

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from exo.api.adapters.responses import ResponseEncoder, ResponsesRequest, to_task_params
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated, ToolCall, Usage
from tests.support.node import TINY_MODEL_ID, ExoNode

HELLO = [{"role": "user", "content": "Hello there"}]


def client(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_non_streaming_response_has_output_text_status_and_usage(node: ExoNode):
    response = client(node).responses.create(
        model=TINY_MODEL_ID, input="Hello there", max_output_tokens=10, temperature=0
    )
    assert response.object == "response" and response.model == TINY_MODEL_ID
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 10
    assert response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_stream_events_are_numbered_in_documented_order_and_match_the_non_streaming_text(node: ExoNode):
    sdk = client(node)
    kwargs = dict(model=TINY_MODEL_ID, input=HELLO, instructions="Be brief.", max_output_tokens=12, temperature=0)
    events = list(sdk.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    whole = sdk.responses.create(**kwargs)
    assert streamed == events[-4].text == final.output_text == whole.output_text
    assert final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_usage_equals_openai_chat_for_the_same_greedy_request(node: ExoNode):
    sdk = client(node)
    response = sdk.responses.create(model=TINY_MODEL_ID, input="Hello there", max_output_tokens=8, temperature=0)
    chat = sdk.chat.completions.create(model=TINY_MODEL_ID, messages=HELLO, max_tokens=8, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def test_bad_requests_are_4xx_in_openai_shape(node: ExoNode):
    with pytest.raises(openai.BadRequestError) as raised:
        client(node).responses.create(model=TINY_MODEL_ID, input="hi", max_output_tokens=0)
    assert raised.value.body["param"] == "max_output_tokens"
    response = node.post("/v1/responses", json={"model": TINY_MODEL_ID})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    with pytest.raises(openai.NotFoundError) as raised:
        client(node).responses.create(model="nobody/nothing", input="hi")
    assert "nobody/nothing" in raised.value.message


def test_client_leaving_mid_stream_cancels_the_task(node: ExoNode):
    body = {"model": TINY_MODEL_ID, "input": "Tell me everything", "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{node.url}/v1/responses", json=body, timeout=30) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 3:
                break
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=20, what="the task dropped")


# The adapter alone: conversions the tiny random model cannot show.


def chunk(**fields) -> ChunkGenerated:
    return ChunkGenerated(command_id=CommandId("c"), **fields)


def test_input_items_become_chat_messages_and_flat_tools_nest():
    request = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "sys",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "t"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain."}]},
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                {"type": "web_search"},
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "reasoning": {"effort": "high"},
        }
    )
    params = to_task_params(request)
    assert [m.role for m in params.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    call = params.messages[2]
    assert call.reasoning_content == "t"
    assert call.tool_calls == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    ]
    assert (params.messages[3].tool_call_id, params.messages[3].content) == ("c1", "rain")
    assert params.messages[4].content == "Rain."
    assert params.tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {"type": "object"}}}
    ]
    assert params.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert params.enable_thinking is True


def test_reasoning_text_and_function_call_chunks_become_items_in_order():
    encoder = ResponseEncoder(ResponsesRequest(model="m", input="hi"))
    chunks = [
        chunk(reasoning="Think"),
        chunk(reasoning="ing."),
        chunk(text="Calling."),
        chunk(
            tool_calls=[ToolCall(id="call_1", name="get_weather", arguments='{"city": "Oslo"}')],
            finish_reason="tool_calls",
            usage=Usage(prompt_tokens=5, completion_tokens=9),
        ),
    ]
    events = encoder.start() + [event for c in chunks for event in encoder.feed(c)]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # Every event parses as the SDK's own types.
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [p.output_index for p in parsed if p.type == "response.output_item.added"] == [0, 1, 2]
    final = Response.model_validate(encoder.body())
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Thinking."
    assert final.output_text == "Calling."
    assert (final.output[2].call_id, final.output[2].arguments) == ("call_1", '{"city": "Oslo"}')
    assert final.usage.total_tokens == 14 and final.status == "completed"


def test_length_is_incomplete_and_error_is_failed():
    encoder = ResponseEncoder(ResponsesRequest(model="m", input="hi"))
    events = encoder.feed(chunk(text="a", finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=1)))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failing = ResponseEncoder(ResponsesRequest(model="m", input="hi"))
    events = failing.feed(chunk(finish_reason="error", error_message="runner died"))
    assert events[-1]["type"] == "response.failed"
    assert Response.model_validate(events[-1]["response"]).error.message == "runner died"
