"""The core API promises through a node running the llama.cpp engine (--engine
llamacpp) on the tiny llama, driven by the official OpenAI SDK: streaming chat,
logprobs, penalties, logit bias, JSON output, stop sequences, cancellation, the prefix
cache and concurrent streams. The tiny llama's GGUF is converted from its float32
checkpoint when the instance loads."""

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

MESSAGES = [{"role": "user", "content": "the cat runs over the moon"}]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    home = tmp_path_factory.mktemp("llamacpp-node") / "home"
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir)}
    with running_node(home, env, args=("--engine", "llamacpp"), models=[TINY_MODEL_ID]) as exo:
        yield exo


@pytest.fixture(scope="module")
def sdk(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(sdk: openai.OpenAI, messages=MESSAGES, **extra):
    return sdk.chat.completions.create(model=TINY_MODEL_ID, messages=messages, temperature=0, **extra)


def test_state_says_the_node_and_the_instance_run_llamacpp(node: ExoNode):
    state = node.state()
    assert [info["engine"] for info in state["nodes"].values()] == ["llamacpp"]
    assert [instance["engine"] for instance in state["instances"].values()] == ["llamacpp"]
    assert "llama.cpp:" in node.logs()


def test_the_runner_reports_the_gguf_conversion_before_it_loads_layers(node: ExoNode):
    statuses = [
        e["event"]["status"]
        for e in node.get("/events").json()
        if e["event"]["kind"] == "RunnerStatusUpdated" and e["event"]["status"]["kind"] == "RunnerLoading"
    ]
    converting = [s for s in statuses if s["totalConvertBytes"]]
    assert converting, statuses
    done = [s["convertedBytes"] for s in converting]
    assert done == sorted(done) and done[-1] == converting[-1]["totalConvertBytes"]
    # Layers load once the GGUF is written.
    first_layer = next(i for i, s in enumerate(statuses) if s["layersLoaded"])
    assert first_layer > statuses.index(converting[-1])


def test_a_streamed_chat_equals_the_whole_answer(sdk: openai.OpenAI):
    whole = greedy(sdk, max_tokens=12)
    assert whole.choices[0].message.content and whole.usage.completion_tokens <= 12
    chunks = list(greedy(sdk, max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_logprobs_are_log_probabilities_with_the_greedy_token_on_top(sdk: openai.OpenAI):
    completion = greedy(sdk, max_tokens=4, logprobs=True, top_logprobs=5)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert len(alternatives) == 5 and alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob == alternatives[0] <= 0
        assert sum(2.718281828**lp for lp in alternatives) <= 1.0 + 1e-4


def test_logit_bias_bans_and_forces_tokens(sdk: openai.OpenAI, tiny_models_dir: Path):
    tokenizer = Tokenizer.from_file(str(tiny_models_dir / TINY_MODEL_ID.replace("/", "--") / "tokenizer.json"))
    first = greedy(sdk, max_tokens=3, logprobs=True).choices[0].logprobs.content[0]
    (first_id,) = tokenizer.encode(first.token, add_special_tokens=False).ids
    banned = greedy(sdk, max_tokens=3, logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first.token
    forced = greedy(sdk, max_tokens=3, logprobs=True, logit_bias={"300": 100})
    assert [entry.token for entry in forced.choices[0].logprobs.content] == [tokenizer.decode([300])] * 3


def test_penalties_change_a_repetitive_answer(sdk: openai.OpenAI):
    plain = greedy(sdk, max_tokens=40).choices[0].message.content
    penalized = [
        greedy(sdk, max_tokens=40, presence_penalty=2.0).choices[0].message.content,
        greedy(sdk, max_tokens=40, frequency_penalty=2.0).choices[0].message.content,
        greedy(sdk, max_tokens=40, extra_body={"repetition_penalty": 3.0}).choices[0].message.content,
    ]
    assert all(text != plain for text in penalized), (plain, penalized)


def test_json_response_format_gives_json(sdk: openai.OpenAI):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 99}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    completion = greedy(
        sdk,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
    )
    value = json.loads(completion.choices[0].message.content)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int) and value["n"] <= 99
    assert completion.choices[0].finish_reason == "stop"


def test_a_stop_sequence_ends_the_answer_before_it(sdk: openai.OpenAI):
    text = greedy(sdk, max_tokens=30).choices[0].message.content
    stop = text[10:14]
    stopped = greedy(sdk, max_tokens=30, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[: text.index(stop)]


def test_a_client_leaving_cancels_and_the_node_answers_on(node: ExoNode, sdk: openai.OpenAI):
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 100000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=body, timeout=30) as response:
        for received, _line in enumerate(response.iter_lines()):
            if received == 6:
                break
    node.wait_for_state(lambda s: s["tasks"] == {}, timeout=20, what="the task dropped")
    assert greedy(sdk, max_tokens=3).choices[0].message.content


def test_a_repeated_prompt_reports_cached_tokens(sdk: openai.OpenAI):
    messages = [{"role": "user", "content": "the quiet dog sleeps under the bright sun " * 4}]
    first = greedy(sdk, messages=messages, max_tokens=4)
    again = greedy(sdk, messages=messages, max_tokens=4)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 1 == cached, (first.usage, again.usage)


def test_four_concurrent_streams_each_answer_as_alone(sdk: openai.OpenAI):
    prompts = [[{"role": "user", "content": "the node " * (i + 1) + "runs"}] for i in range(4)]
    lengths = [20, 35, 50, 28]

    def ask(i: int) -> str:
        chunks = greedy(sdk, messages=prompts[i], max_tokens=lengths[i], stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = [ask(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, range(4)))
    assert together == alone
