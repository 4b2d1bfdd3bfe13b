"""Speculative decoding through the API, on a real node of each engine, with the official
OpenAI SDK: exo's `speculative` field on Chat Completions, Completions and Responses
gives the plain greedy text, usage reports the proposals kept and not kept (OpenAI's
accepted / rejected prediction tokens), `null` is plain decoding, and a bad value is a
400 in OpenAI's error shape."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

# The tiny llama's greedy answer to this repeats itself, so the lookup proposes.
MESSAGES = [{"role": "user", "content": "cluster node model token the cat runs over the quiet moon " * 6}]
ON = {"method": "prompt_lookup", "num_draft": 6}


@pytest.fixture(scope="module", params=["llamacpp", "mlx"])
def node(request, tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    home = tmp_path_factory.mktemp(f"node-{request.param}") / "home"
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir)}
    with running_node(home, env, args=("--engine", request.param), models=[TINY_MODEL_ID]) as exo:
        yield exo


def _sdk(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_completions_with_prompt_lookup_give_the_plain_text(node: ExoNode):
    sdk = _sdk(node)
    asked = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
    plain = sdk.chat.completions.create(**asked)
    fast = sdk.chat.completions.create(**asked, extra_body={"speculative": ON})
    off = sdk.chat.completions.create(**asked, extra_body={"speculative": None})
    assert fast.choices[0].message.content == plain.choices[0].message.content == off.choices[0].message.content
    details = fast.usage.completion_tokens_details
    print(f"kept {details.accepted_prediction_tokens}, not kept {details.rejected_prediction_tokens}")
    assert details.accepted_prediction_tokens > 0
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    for unproposed in (plain, off):
        assert unproposed.usage.completion_tokens_details.accepted_prediction_tokens == 0
        assert unproposed.usage.completion_tokens_details.rejected_prediction_tokens == 0

    streamed = sdk.chat.completions.create(
        **asked, extra_body={"speculative": ON}, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_completions_and_responses_take_the_field_too(node: ExoNode):
    sdk = _sdk(node)
    prompt = MESSAGES[0]["content"]
    plain = sdk.completions.create(model=TINY_MODEL_ID, prompt=prompt, max_tokens=48, temperature=0)
    fast = sdk.completions.create(
        model=TINY_MODEL_ID, prompt=prompt, max_tokens=48, temperature=0, extra_body={"speculative": ON}
    )
    assert fast.choices[0].text == plain.choices[0].text
    assert fast.usage.completion_tokens_details.accepted_prediction_tokens > 0

    asked = {"model": TINY_MODEL_ID, "input": prompt, "max_output_tokens": 48, "temperature": 0}
    plain_response = sdk.responses.create(**asked)
    fast_response = sdk.responses.create(**asked, extra_body={"speculative": ON})
    assert fast_response.output_text == plain_response.output_text
    assert fast_response.usage.output_tokens_details.model_extra["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"method": "prompt_lookup", "num_draft": 0}, "num_draft"),
        ({"method": "prompt_lookup", "num_draft": 99}, "num_draft"),
        ({"method": "medusa"}, "prompt_lookup"),
        ({"method": "prompt_lookup", "drafts": 4}, "drafts"),
        ("yes", "speculative"),
    ],
)
def test_a_bad_speculative_value_is_a_400_naming_it(node: ExoNode, value, named: str):
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 4, "speculative": value}
    response = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"], error
