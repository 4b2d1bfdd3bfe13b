"""DeepSeek V3.2 and V4 write a DSML tool-call block whether or not the request offered
tools (as the seed parses every answer of theirs): a request without tools still gets the
call as a tool call, never the raw markup in its content. A real node serves the two
families' scripted models; the official openai SDK is the client."""

import json
from collections.abc import Iterator

import openai
import pytest

from exo.devtools.scripted_families import FAMILY_SCRIPTS, SAMPLE_MESSAGES
from exo.devtools.scripted_models import make_scripted_model
from tests.support.node import ExoNode, running_node

FAMILIES = ("deepseek_v32", "deepseek_v4")


def model_id(family: str) -> str:
    return f"scripted/{family}"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    models_dir = tmp_path_factory.mktemp("models")
    for family in FAMILIES:
        make_scripted_model(models_dir / model_id(family).replace("/", "--"), family, FAMILY_SCRIPTS[family].script)
    home = tmp_path_factory.mktemp("exo_home")
    with running_node(home, {"EXO_MODELS_DIRS": str(models_dir)}, models=[model_id(f) for f in FAMILIES]) as exo:
        yield exo


def ask(node: ExoNode, family: str, stream: bool):
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # No tools offered.
    return client.chat.completions.create(
        model=model_id(family),
        messages=SAMPLE_MESSAGES,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=64,
        stream=stream,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dsml_call_without_tools_is_a_tool_call(node: ExoNode, family: str) -> None:
    expected = FAMILY_SCRIPTS[family]
    choice = ask(node, family, stream=False).choices[0]  # type: ignore[union-attr]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    assert calls == list(expected.tool_calls)
    assert choice.message.content == expected.content
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_streamed_dsml_call_without_tools_is_a_tool_call(node: ExoNode, family: str) -> None:
    expected = FAMILY_SCRIPTS[family]
    content, names, arguments, finish = "", "", "", []
    for chunk in ask(node, family, stream=True):
        for choice in chunk.choices:  # type: ignore[union-attr]
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                names += call.function.name or "" if call.function else ""
                arguments += call.function.arguments or "" if call.function else ""
            finish += [choice.finish_reason] if choice.finish_reason else []
    assert "DSML" not in content and content == expected.content
    assert [(names, json.loads(arguments))] == list(expected.tool_calls)
    assert finish == ["tool_calls"]
