"""A thinking model of an ordinary architecture: config.json says `llama` (as
DeepSeek-R1-Distill-Llama's does), so the family table knows no think markers; only the
tokenizer's `<think>`/`</think>` tokens tell. Its reasoning must still come back apart from
the answer in every API, streamed and not: OpenAI's reasoning_content, the Responses
API's reasoning item, Claude's thinking blocks and Ollama's `thinking`; and Ollama's
`show` lists the "thinking" capability for it (and not for a plain llama beside it). A
real node serves a scripted model (the official SDKs are the clients)."""

import json
from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest

from exo.devtools.scripted_models import make_scripted_model
from exo.devtools.tiny_models import make_tiny_llama
from tests.support.node import ExoNode, running_node

MODEL = "scripted/r1-distill-llama"
PLAIN_MODEL = "acme/plain-llama"
# The template's generation prompt ends in "<think>\n": the output starts inside the block.
SCRIPT = ("Okay, the user wants", " the weather in Paris.\n", "</think>", "\n\nIt is", " sunny in Paris.")
REASONING = "Okay, the user wants the weather in Paris.\n"
CONTENT = "\n\nIt is sunny in Paris."
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    models_dir = tmp_path_factory.mktemp("models")
    model_dir = make_scripted_model(models_dir / MODEL.replace("/", "--"), "r1_distill_llama", SCRIPT)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "llama"
    make_tiny_llama(models_dir / PLAIN_MODEL.replace("/", "--"))
    with running_node(tmp_path_factory.mktemp("exo_home"), {"EXO_MODELS_DIRS": str(models_dir)}, models=[MODEL]) as exo:
        yield exo


def openai_client(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_completions(node: ExoNode) -> None:
    message = (
        openai_client(node)
        .chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=32)  # type: ignore[arg-type]
        .choices[0]
        .message
    )
    assert (message.model_extra or {}).get("reasoning_content") == REASONING
    assert message.content == CONTENT


def test_chat_completions_streamed(node: ExoNode) -> None:
    reasoning, content = "", ""
    stream = openai_client(node).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=32,
        stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (REASONING, CONTENT)


def responses_parts(output: list) -> tuple[str, str]:
    reasoning = "".join(part.text for item in output if item.type == "reasoning" for part in item.content or [])
    text = "".join(part.text for item in output if item.type == "message" for part in item.content)
    return reasoning, text


def test_responses(node: ExoNode) -> None:
    response = openai_client(node).responses.create(
        model=MODEL, input="What is the weather in Paris?", max_output_tokens=32
    )
    assert responses_parts(response.output) == (REASONING, CONTENT)


def test_responses_streamed(node: ExoNode) -> None:
    with openai_client(node).responses.stream(
        model=MODEL, input="What is the weather in Paris?", max_output_tokens=32
    ) as stream:
        response = stream.get_final_response()
    assert responses_parts(response.output) == (REASONING, CONTENT)


def claude_client(node: ExoNode) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0, timeout=60)


def claude_parts(blocks: list) -> tuple[str, str]:
    thinking = "".join(block.thinking for block in blocks if block.type == "thinking")
    text = "".join(block.text for block in blocks if block.type == "text")
    return thinking, text


def test_claude_messages(node: ExoNode) -> None:
    message = claude_client(node).messages.create(model=MODEL, messages=MESSAGES, max_tokens=32)  # type: ignore[arg-type]
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert claude_parts(message.content) == (REASONING, CONTENT)


def test_claude_messages_streamed(node: ExoNode) -> None:
    with claude_client(node).messages.stream(model=MODEL, messages=MESSAGES, max_tokens=32) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert claude_parts(message.content) == (REASONING, CONTENT)


def test_ollama_chat(node: ExoNode) -> None:
    response = ollama.Client(host=f"{node.url}/ollama").chat(model=MODEL, messages=MESSAGES, think=True)
    assert (response.message.thinking, response.message.content) == (REASONING, CONTENT)


def test_ollama_chat_streamed(node: ExoNode) -> None:
    thinking, content = "", ""
    for part in ollama.Client(host=f"{node.url}/ollama").chat(model=MODEL, messages=MESSAGES, think=True, stream=True):
        thinking += part.message.thinking or ""
        content += part.message.content or ""
    assert (thinking, content) == (REASONING, CONTENT)


def test_ollama_show_lists_thinking_where_the_tokenizer_has_think_tokens(node: ExoNode) -> None:
    client = ollama.Client(host=f"{node.url}/ollama")
    assert "thinking" in (client.show(MODEL).capabilities or [])
    assert "thinking" not in (client.show(PLAIN_MODEL).capabilities or [])
