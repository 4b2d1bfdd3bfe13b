"""POST /v1/cancel/{id} stops a running generation from outside its stream."""

import json
import threading

import httpx
import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode


def long_chat(stream: bool = True) -> dict:
    # Greedy decoding of the tiny model's random weights never picks the end-of-sequence
    # token here, so this runs for seconds: long enough to be cancelled midway.
    return {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 3000,
        "temperature": 0.0,
        "stream": stream,
    }


def sse_data(line: str) -> str | None:
    return line.removeprefix("data: ") if line.startswith("data: ") else None


def test_unknown_id_is_a_404_in_openai_shape(node: ExoNode):
    response = node.post("/v1/cancel/chatcmpl-nothing-runs-here")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and "chatcmpl-nothing-runs-here" in error["message"]


def test_cancelling_a_chat_stream_by_its_completion_id_ends_it_with_finish_reason_cancelled(node: ExoNode):
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=long_chat(), timeout=60) as stream:
        lines = stream.iter_lines()
        first = json.loads(next(data for line in lines if (data := sse_data(line))))
        completion_id = first["id"]
        response = node.post(f"/v1/cancel/{completion_id}")
        assert response.status_code == 200, response.text
        assert response.json() == {"cancelled": True, "id": completion_id}
        rest = [data for line in lines if (data := sse_data(line))]
    assert rest[-1] == "[DONE]"
    finish_reasons = [c["choices"][0]["finish_reason"] for c in map(json.loads, rest[:-1]) if c.get("choices")]
    assert finish_reasons[-1] == "cancelled"
    # Cancelled well before max_tokens.
    assert len(rest) < 3000
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=10, what="the cancelled task gone")
    assert node.post(f"/v1/cancel/{completion_id}").status_code == 404


def test_cancelling_a_non_streaming_request_by_its_command_id(node: ExoNode):
    result: dict = {}

    def request() -> None:
        result["response"] = httpx.post(f"{node.url}/v1/chat/completions", json=long_chat(stream=False), timeout=60)

    thread = threading.Thread(target=request)
    thread.start()
    state = node.wait_for_state(lambda s: s["tasks"], timeout=10, what="the task running")
    command_id = next(iter(state["tasks"].values()))["commandId"]
    response = node.post(f"/v1/cancel/{command_id}")
    assert response.status_code == 200, response.text
    thread.join(timeout=30)
    body = result["response"].json()
    assert body["id"] == f"chatcmpl-{command_id}"
    assert body["choices"][0]["finish_reason"] == "cancelled"
    assert body["usage"]["completion_tokens"] < 3000


def test_cancelling_a_claude_stream_by_its_message_id_ends_the_stream(node: ExoNode):
    body = {
        "model": TINY_MODEL_ID,
        "max_tokens": 3000,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "stream": True,
    }
    with httpx.stream("POST", f"{node.url}/v1/messages", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        start = json.loads(next(data for line in lines if (data := sse_data(line))))
        message_id = start["message"]["id"]
        assert node.post(f"/v1/cancel/{message_id}").json() == {"cancelled": True, "id": message_id}
        events = [json.loads(data) for line in lines if (data := sse_data(line))]
    assert events[-1]["type"] == "message_stop"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/ollama/api/chat"])
def test_a_client_that_hangs_up_on_a_non_streamed_request_cancels_it(node: ExoNode, path: str):
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 200000,
        "stream": False,
        "options": {"num_predict": 200000, "temperature": 0},
        "temperature": 0,
    }
    # The tiny model on llama.cpp fills its 4,096-token context in about 1.5 s here: hang
    # up well before that.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{node.url}{path}", json=body, timeout=0.5)
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=10, what="the abandoned task dropped")
    response = node.post("/v1/chat/completions", json={**long_chat(stream=False), "max_tokens": 3})
    assert response.status_code == 200, response.text
