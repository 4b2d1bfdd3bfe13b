"""What unmodified agent clients (Claude Code, opencode, litellm, Open WebUI) meet, against
a real offline node serving scripted models: the context check counts the tools and the
chat template, every request leaves a log line, JSON bodies come without a JSON
Content-Type, streams are never silent during prefill, `HEAD /` answers, and the client
lists show only what the cluster can serve. The clients are the official SDKs and httpx."""

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from exo.api.checks import chat_prompt_token_count, chat_tokenizer_at
from exo.devtools.scripted_families import GET_WEATHER_TOOL, PLAIN_SCRIPT, SAMPLE_MESSAGES
from exo.devtools.scripted_models import make_scripted_model
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from tests.support.node import ExoNode, running_node

MODEL = "scripted/qwen3"
SMALL = "scripted/qwen3-small-context"
# The scripted tokenizer's 512-entry BPE spends many tokens on text: the sample
# conversation is 40 tokens, with the get_weather tool's schema in the template 556.
SMALL_CONTEXT = 300
EXPECTED = PLAIN_SCRIPT


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("models")
    make_scripted_model(models / MODEL.replace("/", "--"), "qwen3", EXPECTED.script)
    small = make_scripted_model(models / SMALL.replace("/", "--"), "qwen3", EXPECTED.script)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": SMALL_CONTEXT}))
    return models


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ExoNode]:
    # Prefill in steps of 16 tokens, so a short prompt already reports prefill progress.
    env = {"EXO_MODELS_DIRS": str(models_dir), "EXO_PREFILL_STEP": "16"}
    with running_node(tmp_path_factory.mktemp("exo_home"), env, ("--offline",), models=[MODEL, SMALL]) as exo_node:
        yield exo_node


def openai_client(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)


def many_tools(count: int) -> list[dict]:
    return [
        {**GET_WEATHER_TOOL, "function": {**GET_WEATHER_TOOL["function"], "name": f"get_weather_{i}"}}
        for i in range(count)
    ]


def test_tools_count_against_the_context_in_every_api(node: ExoNode) -> None:
    # Without tools the prompt fits the small context and is served.
    served = openai_client(node).chat.completions.create(model=SMALL, messages=SAMPLE_MESSAGES, max_tokens=64)  # type: ignore[arg-type]
    assert served.choices[0].message.content == EXPECTED.content

    tools = many_tools(24)
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(node).chat.completions.create(model=SMALL, messages=SAMPLE_MESSAGES, tools=tools, max_tokens=64)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded"
    assert f"> {SMALL_CONTEXT} maximum" in refused.value.message

    claude_tools = [
        {"name": t["function"]["name"], "description": "d", "input_schema": t["function"]["parameters"]} for t in tools
    ]
    claude = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as claude_refused:
        claude.messages.create(model=SMALL, messages=SAMPLE_MESSAGES, tools=claude_tools, max_tokens=64)  # type: ignore[arg-type]
    # Claude Code compacts the conversation on exactly this message.
    assert "prompt is too long" in claude_refused.value.message
    assert claude_refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

    with pytest.raises(ollama.ResponseError) as ollama_refused:
        ollama.Client(host=f"{node.url}/ollama").chat(model=SMALL, messages=SAMPLE_MESSAGES, tools=tools)
    assert ollama_refused.value.status_code == 400
    assert "prompt is too long" in ollama_refused.value.error


def test_the_check_counts_the_prompt_as_the_engine_builds_it(node: ExoNode, models_dir: Path) -> None:
    served = openai_client(node).chat.completions.create(
        model=MODEL,
        messages=SAMPLE_MESSAGES,  # type: ignore[arg-type]
        tools=[GET_WEATHER_TOOL],  # type: ignore[list-item]
        max_tokens=64,
    )
    assert served.usage is not None
    chat = chat_tokenizer_at(models_dir / MODEL.replace("/", "--"))
    assert chat is not None
    params = TextGenerationTaskParams(
        model=ModelId(MODEL), messages=[ChatMessage(**m) for m in SAMPLE_MESSAGES], tools=[GET_WEATHER_TOOL]
    )
    assert chat_prompt_token_count(chat, params, "post_last_user") == served.usage.prompt_tokens


def test_every_request_is_logged_without_its_body(node: ExoNode) -> None:
    secret = "sk-do-not-log-me"
    headers = {"Authorization": f"Bearer {secret}"}
    httpx.post(f"{node.url}/v1/chat/completions", json={"model": SMALL, "messages": []}, headers=headers, timeout=30)
    httpx.post(
        f"{node.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": secret}], "max_tokens": 64},
        headers=headers,
        timeout=60,
    )
    logs = node.logs()
    assert "POST /v1/chat/completions 400" in logs
    refused = [
        line for line in logs.splitlines() if "POST /v1/chat/completions 400" in line and "at least 1 item" in line
    ]
    assert refused and f"model={SMALL}" in refused[-1]
    assert any("POST /v1/chat/completions 200" in line and f"model={MODEL}" in line for line in logs.splitlines())
    assert secret not in logs


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_is_read_whatever_its_content_type(node: ExoNode, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"model": MODEL, "messages": SAMPLE_MESSAGES, "stream": False}).encode()
    chat = httpx.post(f"{node.url}/ollama/api/chat", content=body, headers=headers, timeout=60)
    assert chat.status_code == 200, chat.text
    assert chat.json()["message"]["content"] == EXPECTED.content
    openai_chat = httpx.post(f"{node.url}/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert openai_chat.status_code == 200, openai_chat.text
    show = httpx.post(f"{node.url}/ollama/api/show", content=json.dumps({"model": MODEL}), headers=headers)
    assert show.status_code == 200, show.text


def stream_lines(node: ExoNode, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{node.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line]


def long_messages(topic: str) -> list[dict]:
    """Long enough for several 16-token prefill steps, and a prompt of its own per test
    (the prefix cache would skip a prompt seen before)."""
    return [{"role": "user", "content": f"Tell me about {topic}, please. " * 6}]


def test_claude_streams_ping_while_prefilling(node: ExoNode) -> None:
    lines = stream_lines(
        node, "/v1/messages", {"model": MODEL, "messages": long_messages("Claude"), "max_tokens": 64, "stream": True}
    )
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    first_block = events.index("content_block_start")
    assert events[0] == "message_start"
    assert events[1:first_block].count("ping") >= 3, events[:first_block]
    # The official SDK takes the pings in its stride.
    claude = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60)
    with claude.messages.stream(model=MODEL, messages=long_messages("the SDK"), max_tokens=64) as stream:  # type: ignore[arg-type]
        assert any(block.type == "text" for block in stream.get_final_message().content)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": long_messages("chats")}),
        ("/v1/responses", {"input": long_messages("responses")[0]["content"]}),
        ("/v1/completions", {"prompt": long_messages("completions")[0]["content"]}),
    ],
)
def test_other_sse_streams_keep_alive_while_prefilling(node: ExoNode, path: str, body: dict) -> None:
    lines = stream_lines(node, path, {"model": MODEL, "max_tokens": 8, "stream": True, **body})
    assert sum(line.startswith(": prefill") for line in lines) >= 3, lines[:8]


def test_head_of_the_root_answers(node: ExoNode) -> None:
    response = httpx.head(f"{node.url}/")
    assert response.status_code in (200, 307), response.status_code


def test_an_offline_node_lists_only_what_it_can_serve(node: ExoNode) -> None:
    # The demo model ships in the package's own models dir.
    on_disk = {MODEL, SMALL, "exo/demo-chat"}
    listed = {entry["id"] for entry in node.get("/v1/models").json()["data"]}
    assert listed == on_disk
    tags = {entry["name"] for entry in node.get("/ollama/api/tags").json()["models"]}
    assert tags == on_disk
    # The whole catalog stays at /models.
    catalog = {card["model_id"] for card in node.get("/models").json()}
    assert on_disk < catalog and len(catalog) > 10


def test_models_list_their_reasoning_dialect(node: ExoNode) -> None:
    entries = {entry["id"]: entry for entry in node.get("/v1/models").json()["data"]}
    # Qwen3's cards send back only the reasoning after the last user message.
    assert entries[MODEL]["reasoning_dialect"] == "post_last_user"
