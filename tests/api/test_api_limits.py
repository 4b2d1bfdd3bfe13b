"""Oversized request bodies are a 413 and over-long prompts a 400, in each API's error shape."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_MAX_REQUEST_BYTES": str(LIMIT)}
    home = tmp_path_factory.mktemp("limits") / "exo_home"
    with running_node(home, env, ("--no-auto-place",), [TINY_MODEL_ID]) as node:
        yield node


def big_chat(size: int) -> dict:
    return {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x" * size}], "max_tokens": 4}


def test_a_body_over_the_limit_is_a_413_in_openai_shape(node: ExoNode):
    response = node.post("/v1/chat/completions", json=big_chat(LIMIT + 1))
    assert response.status_code == 413
    error = response.json()["error"]
    assert "EXO_MAX_REQUEST_BYTES" in error["message"] and error["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_a_413_too(node: ExoNode):
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "acme/tiny", "messages": [{"role": "user", "content": "'
        for _ in range(LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}]}'

    response = httpx.post(
        f"{node.url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 413
    assert "EXO_MAX_REQUEST_BYTES" in response.json()["error"]["message"]


def test_each_api_answers_413_in_its_own_shape(node: ExoNode):
    claude = node.post("/v1/messages", json=big_chat(LIMIT) | {"max_tokens": 4})
    assert claude.status_code == 413
    assert claude.json()["type"] == "error" and claude.json()["error"]["type"] == "request_too_large"
    ollama = node.post("/ollama/api/chat", json=big_chat(LIMIT))
    assert ollama.status_code == 413 and "EXO_MAX_REQUEST_BYTES" in ollama.json()["error"]


def test_a_body_under_the_limit_is_served(node: ExoNode):
    response = node.post("/v1/chat/completions", json=big_chat(100))
    assert response.status_code == 200, response.text


def test_a_prompt_longer_than_the_context_is_a_400(node: ExoNode):
    # The tiny model's card has a context of 4096 tokens; this is well over, yet under the body limit.
    prompt = " ".join(f"w{i}" for i in range(6000))
    response = node.post(
        "/v1/chat/completions",
        json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "prompt is too long" in error["message"]
    assert "4096" in error["message"]
    completion = node.post("/v1/completions", json={"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 4})
    assert completion.status_code == 400 and "prompt is too long" in completion.json()["error"]["message"]
    ollama = node.post("/ollama/api/generate", json={"model": TINY_MODEL_ID, "prompt": prompt, "stream": False})
    assert ollama.status_code == 400 and "prompt is too long" in ollama.json()["error"]
