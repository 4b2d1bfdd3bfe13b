"""OpenAI legacy Completions: the official openai SDK against one real node."""

from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from exo.api.adapters.completions import CompletionEncoder, CompletionRequest, to_task_params
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated, Usage
from tests.support.node import TINY_MODEL_ID, ExoNode

PROMPT = "Once upon a time"


def client(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_streamed_or_not_gives_the_same_greedy_text_and_usage(node: ExoNode):
    sdk = client(node)
    whole = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.model == TINY_MODEL_ID
    assert whole.choices[0].text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and 0 < whole.usage.completion_tokens <= 10
    if whole.choices[0].finish_reason == "length":
        assert whole.usage.completion_tokens == 10

    chunks = list(
        sdk.completions.create(
            model=TINY_MODEL_ID,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == []
    streamed_usage = chunks[-1].usage
    assert (streamed_usage.prompt_tokens, streamed_usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    # The same prompt again: the prefix cache did the prompt's work the second time.
    assert streamed_usage.prompt_tokens_details.cached_tokens > 0


def test_token_id_prompt_answers_like_the_same_text(node: ExoNode, tiny_models_dir: Path):
    tokenizer = Tokenizer.from_file(str(tiny_models_dir / "acme--tiny" / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    sdk = client(node)
    by_text = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = sdk.completions.create(model=TINY_MODEL_ID, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage


def test_echo_puts_the_prompt_first_and_logprobs_are_accepted(node: ExoNode):
    sdk = client(node)
    plain = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    with_logprobs = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=3, logprobs=2)
    assert with_logprobs.usage.completion_tokens > 0


def test_logprobs_stay_json_numbers_under_an_extreme_repetition_penalty(node: ExoNode):
    # Found by schemathesis: a penalty of 5e-324 divides logits by ~0, the log
    # probabilities became -inf/NaN, and serialising them was a 500.
    sdk = client(node)
    for extra in ({"repetition_penalty": 5e-324}, {"repetition_penalty": 1e300}):
        completion = sdk.completions.create(
            model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=4, logprobs=3, extra_body=extra
        )
        logprobs = completion.choices[0].logprobs
        values = logprobs.token_logprobs + [v for top in logprobs.top_logprobs for v in top.values()]
        assert values and all(-9999.0 <= v <= 0.0 for v in values), values


def test_stop_sequence_cuts_the_text(node: ExoNode):
    sdk = client(node)
    base = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    assert len(base) > 3
    stop = base[2:4]
    stopped = sdk.completions.create(model=TINY_MODEL_ID, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == base[: base.index(stop)]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": PROMPT, "n": 2}, "n"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "logprobs": 9}, "logprobs"),
        ({}, "prompt"),
    ],
)
def test_bad_requests_are_400s_in_openai_shape(node: ExoNode, extra: dict, param: str):
    response = node.post("/v1/completions", json={"model": TINY_MODEL_ID, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] in (param, None)


def test_unknown_model_is_a_404(node: ExoNode):
    with pytest.raises(openai.NotFoundError) as raised:
        client(node).completions.create(model="nobody/nothing", prompt=PROMPT)
    assert "nobody/nothing" in raised.value.message


def test_client_leaving_mid_stream_cancels_the_task(node: ExoNode):
    body = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 100000, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=30) as response:
        for received, _line in enumerate(response.iter_lines()):
            if received == 6:
                break
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=20, what="the task dropped")


def test_adapter_passes_the_raw_prompt_and_logprobs():
    request = CompletionRequest(model="m", prompt=[[1, 2, 3]], logprobs=3, stop="x")
    params = to_task_params(request, "decoded")
    assert params.prompt == [1, 2, 3] and params.logprobs and params.top_logprobs == 3 and params.stop == ["x"]
    assert params.max_tokens == 16  # OpenAI's default for this API


def test_encoder_maps_finish_reasons_and_echo():
    encoder = CompletionEncoder("cmpl-1", "m", echo="Hi")
    chunk = ChunkGenerated(
        command_id=CommandId("c"),
        text="!",
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=2, completion_tokens=1),
    )
    (event,) = encoder.feed(chunk)
    assert event["choices"][0] == {"index": 0, "text": "Hi!", "logprobs": None, "finish_reason": "stop"}
    assert encoder.body()["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 1,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
