"""Ollama's API: the official ollama SDK pointed at http://HOST:PORT/ollama of one real
node, and the adapter's conversions (tool calls and thinking) on hand-made chunks."""

import httpx
import ollama
import openai
import pytest

from exo.api.adapters.ollama import OllamaChatRequest, OllamaEncoder, OllamaGenerateRequest, chat_task_params
from exo.api.adapters.ollama import generate_task_params as generate_params
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated, ToolCall, Usage
from tests.support.node import TINY_MODEL_ID, ExoNode

HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0, "num_predict": 10}


def client(node: ExoNode) -> ollama.Client:
    return ollama.Client(host=f"{node.url}/ollama", timeout=60)


def test_chat_streamed_by_default_matches_non_streaming_and_openai_usage(node: ExoNode):
    sdk = client(node)
    parts = list(sdk.chat(model=TINY_MODEL_ID, messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].done_reason in ("stop", "length")
    streamed = "".join(p.message.content or "" for p in parts)
    whole = sdk.chat(model=TINY_MODEL_ID, messages=HELLO, options=GREEDY)
    assert whole.done and whole.message.role == "assistant"
    assert whole.message.content == streamed
    assert (whole.prompt_eval_count, whole.eval_count) == (parts[-1].prompt_eval_count, parts[-1].eval_count)
    assert 0 < whole.eval_count <= 10 and whole.total_duration > 0
    chat = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=TINY_MODEL_ID, messages=HELLO, max_tokens=10, temperature=0
    )
    assert chat.choices[0].message.content == whole.message.content
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (whole.prompt_eval_count, whole.eval_count)


def test_generate_streamed_and_not_and_raw(node: ExoNode):
    sdk = client(node)
    parts = list(sdk.generate(model=TINY_MODEL_ID, prompt="Once upon a time", options=GREEDY, stream=True))
    whole = sdk.generate(model=TINY_MODEL_ID, prompt="Once upon a time", options=GREEDY)
    assert "".join(p.response for p in parts) == whole.response and whole.response
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count > 0
    raw = sdk.generate(model=f"{TINY_MODEL_ID}:latest", prompt="Once upon a time", raw=True, options=GREEDY)
    assert raw.done and raw.eval_count > 0
    loaded = sdk.generate(model=TINY_MODEL_ID)
    assert loaded.done and loaded.done_reason == "load"


def test_options_stop_and_num_predict(node: ExoNode):
    sdk = client(node)
    base = sdk.generate(model=TINY_MODEL_ID, prompt="cat", options={"temperature": 0, "num_predict": 20}).response
    assert len(base) > 3
    stop = base[2:4]
    stopped = sdk.generate(
        model=TINY_MODEL_ID, prompt="cat", options={"temperature": 0, "num_predict": 20, "stop": [stop]}
    )
    assert stopped.response == base[: base.index(stop)] and stopped.done_reason == "stop"
    short = sdk.generate(model=TINY_MODEL_ID, prompt="cat", options={"temperature": 0, "num_predict": 2})
    assert short.eval_count <= 2
    seeded = [
        sdk.generate(
            model=TINY_MODEL_ID, prompt="dog", options={"temperature": 1, "seed": 7, "top_k": 40, "top_p": 0.9}
        )
        for _ in range(2)
    ]
    assert seeded[0].response == seeded[1].response


def test_tags_show_ps_and_version(node: ExoNode):
    sdk = client(node)
    assert TINY_MODEL_ID in [m.model for m in sdk.list().models]
    shown = sdk.show(TINY_MODEL_ID)
    assert "completion" in shown.capabilities and shown.modelinfo["general.block_count"] > 0
    assert [m.model for m in sdk.ps().models] == [TINY_MODEL_ID]
    assert node.get("/ollama/api/version").json()["version"]


def test_errors_are_4xx_in_ollama_shape(node: ExoNode):
    with pytest.raises(ollama.ResponseError) as raised:
        client(node).chat(model="nobody/nothing", messages=HELLO)
    assert raised.value.status_code == 404 and "nobody/nothing" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        client(node).show("nobody/nothing")
    assert raised.value.status_code == 404
    response = node.post("/ollama/api/chat", json={"model": TINY_MODEL_ID, "messages": []})
    assert response.status_code == 400 and isinstance(response.json()["error"], str)
    response = node.post("/ollama/api/generate", json={"model": TINY_MODEL_ID, "prompt": "x", "options": {"top_p": 5}})
    assert response.status_code == 400 and "top_p" in response.json()["error"]


def test_client_leaving_mid_stream_cancels_the_task(node: ExoNode):
    body = {"model": TINY_MODEL_ID, "messages": HELLO, "options": {"temperature": 0}}
    with httpx.stream("POST", f"{node.url}/ollama/api/chat", json=body, timeout=30) as response:
        for received, _line in enumerate(response.iter_lines()):
            if received == 4:
                break
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=20, what="the task dropped")


# The adapter alone: conversions the tiny random model cannot show.


def test_requests_convert_tools_thinking_images_and_raw_prompts():
    request = OllamaChatRequest.model_validate(
        {
            "model": "m",
            "think": True,
            "options": {"num_predict": -1, "stop": ["END"]},
            "messages": [
                {"role": "user", "content": "Weather?", "images": ["AAA"]},
                {
                    "role": "assistant",
                    "content": "",
                    "thinking": "use the tool",
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
                },
                {"role": "tool", "content": "rain", "tool_name": "get_weather"},
            ],
        }
    )
    params = chat_task_params(request)
    user, assistant, tool = params.messages
    # Images before the text, as Ollama places them.
    assert user.content == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
        {"type": "text", "text": "Weather?"},
    ]
    assert assistant.reasoning_content == "use the tool"
    assert assistant.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert (tool.role, tool.name, tool.content) == ("tool", "get_weather", "rain")
    assert params.enable_thinking is True and params.max_tokens is None and params.stop == ["END"]
    raw = generate_params(OllamaGenerateRequest(model="m", prompt="[INST] hi", raw=True, system="ignored"))
    assert raw.prompt == "[INST] hi"
    templated = generate_params(OllamaGenerateRequest(model="m", prompt="hi", system="sys", think=False))
    assert [m.role for m in templated.messages] == ["system", "user"] and templated.enable_thinking is False


def test_thinking_and_tool_call_chunks_become_ollama_messages():
    encoder = OllamaEncoder("m", "chat", started_ns=0, clock=lambda: 10)
    chunk = ChunkGenerated(command_id=CommandId("c"), reasoning="hmm")
    assert encoder.feed(chunk)[0]["message"] == {"role": "assistant", "content": "", "thinking": "hmm"}
    last = ChunkGenerated(
        command_id=CommandId("c"),
        tool_calls=[ToolCall(id="x", name="get_weather", arguments='{"city": "Oslo"}')],
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=3, completion_tokens=4),
    )
    objects = encoder.feed(last)
    assert objects[0]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert objects[1]["done"] and objects[1]["done_reason"] == "stop" and objects[1]["eval_count"] == 4
    body = ollama.ChatResponse.model_validate(encoder.body())
    assert body.message.thinking == "hmm" and body.message.tool_calls[0].function.arguments == {"city": "Oslo"}
    assert body.total_duration == 10
