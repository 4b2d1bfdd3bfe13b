"""Reasoning and tool calling per model family, through a real node's OpenAI API: each
family's scripted model writes thinking, a little content and one get_weather call in
its own markup, and the official openai SDK gets exactly the expected reasoning_content,
content and tool call back, streamed and not, on one node and split over two."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from exo.devtools.scripted_families import FAMILY_SCRIPTS, GET_WEATHER_TOOL, SAMPLE_MESSAGES
from exo.devtools.scripted_models import make_scripted_model
from exo.engine.llamacpp.support import dir_refusal
from exo.shared.types.instances import EngineKind
from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.node import DEFAULT_ENGINE, ExoNode, start_node, stop_node

# Qwen3 opens a tool call and stops inside its JSON arguments.
TRUNCATED_MODEL_ID = "scripted/qwen3-truncated"
TRUNCATED_SCRIPT = (
    "<think>",
    "\nThe user wants the weather.",
    "\n</th",
    "ink>",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": {"ci',
)
# Every marker a family may write; none may reach the client's content.
MARKER_FRAGMENTS = ("<think", "think>", "<tool_call", "tool_call", "<|", "|>", "DSML", "<invoke", "<arg_", "<parameter")


def model_id(family: str) -> str:
    return f"scripted/{family}"


def sdk(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scripted_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models_dir = tmp_path_factory.mktemp("scripted_models")
    for family, expected in FAMILY_SCRIPTS.items():
        make_scripted_model(models_dir / model_id(family).replace("/", "--"), family, expected.script)
    make_scripted_model(models_dir / TRUNCATED_MODEL_ID.replace("/", "--"), "qwen3", TRUNCATED_SCRIPT)
    return models_dir


def place(node: ExoNode, model: str, sharding: str = "Pipeline", min_nodes: int = 1) -> str:
    response = node.post("/place_instance", json={"model_id": model, "sharding": sharding, "min_nodes": min_nodes})
    assert response.status_code == 200, response.text
    return response.json()["instance_id"]


def await_ready(node: ExoNode, instance_id: str) -> None:
    with httpx.stream("GET", f"{node.url}/instance/await", params={"instance_id": instance_id}, timeout=180) as stream:
        events = [line for line in stream.iter_lines() if line.startswith(("event:", "data:"))]
    assert "event: ready" in events, events[-4:]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, scripted_models_dir: Path) -> Iterator[ExoNode]:
    """One node serving every scripted model at once: they are a few MB each."""
    exo_node = start_node(tmp_path_factory.mktemp("exo_home"), {"EXO_MODELS_DIRS": str(scripted_models_dir)})
    try:
        node_id = exo_node.get("/node_id").json()
        exo_node.wait_for_state(lambda s: node_id in s["nodes"], what="this node in the topology")
        models = [model_id(family) for family in FAMILY_SCRIPTS] + [TRUNCATED_MODEL_ID]
        instances = [place(exo_node, model) for model in models]
        for instance_id in instances:
            await_ready(exo_node, instance_id)
        yield exo_node
    except BaseException:
        print(f"--- exo node log ---\n{exo_node.logs()[-20000:]}")
        raise
    finally:
        stop_node(exo_node)


def ask(node: ExoNode, model: str, stream: bool):
    return sdk(node).chat.completions.create(
        model=model,
        messages=SAMPLE_MESSAGES,
        tools=[GET_WEATHER_TOOL],
        temperature=0.0,
        max_tokens=64,
        stream=stream,
    )


def assert_no_markers(content: str) -> None:
    leaked = [fragment for fragment in MARKER_FRAGMENTS if fragment in content]
    assert not leaked, f"marker text {leaked} in content {content!r}"


def streamed_answer(node: ExoNode, model: str) -> tuple[str, str, list[tuple[str, str, dict]], list[str]]:
    """Reasoning, content, tool calls (name, id, arguments) and finish reasons of a streamed answer."""
    reasoning, content, finish_reasons = "", "", []
    calls: dict[int, dict] = {}
    for chunk in ask(node, model, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += call.id or ""
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    tool_calls = [(c["name"], c["id"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return reasoning, content, tool_calls, finish_reasons


def assert_answer(family: str, reasoning: str, content: str, tool_calls: list[tuple[str, str, dict]]) -> None:
    expected = FAMILY_SCRIPTS[family]
    assert reasoning == expected.reasoning
    assert content == expected.content
    assert_no_markers(content)
    assert [(name, arguments) for name, _, arguments in tool_calls] == list(expected.tool_calls)
    assert all(call_id for _, call_id, _ in tool_calls), "every tool call needs an id"


@pytest.mark.parametrize("family", sorted(FAMILY_SCRIPTS))
def test_streamed_answer_has_the_family_reasoning_content_and_tool_call(node: ExoNode, family: str) -> None:
    reasoning, content, tool_calls, finish_reasons = streamed_answer(node, model_id(family))

    assert_answer(family, reasoning, content, tool_calls)
    assert finish_reasons == ["tool_calls"]


@pytest.mark.parametrize("family", sorted(FAMILY_SCRIPTS))
def test_answer_has_the_family_reasoning_content_and_tool_call(node: ExoNode, family: str) -> None:
    completion = ask(node, model_id(family), stream=False)

    choice = completion.choices[0]
    message = choice.message
    tool_calls = [(c.function.name, c.id, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert_answer(family, (message.model_extra or {}).get("reasoning_content") or "", message.content or "", tool_calls)
    assert all(call.type == "function" for call in message.tool_calls or [])
    assert choice.finish_reason == "tool_calls"


def test_each_family_runs_on_llama_cpp_where_it_can(node: ExoNode, scripted_models_dir: Path) -> None:
    """The node runs llama.cpp (the default here): every family the GGUF converter covers
    is served by it, and the others by MLX on the same node."""
    if DEFAULT_ENGINE != EngineKind.LlamaCpp:
        pytest.fail(f"this machine's default engine is {DEFAULT_ENGINE.value}: the test is for a llama.cpp node")
    engines = {i["shardAssignments"]["modelId"]: i["engine"] for i in node.state()["instances"].values()}
    dirs = {model_id(family): scripted_models_dir / model_id(family).replace("/", "--") for family in FAMILY_SCRIPTS}
    expected = {model: "mlx" if dir_refusal(path) else "llamacpp" for model, path in dirs.items()}
    assert {model: engines[model] for model in expected} == expected
    assert {expected[model_id(family)] for family in ("qwen3", "glm4_moe", "minimax", "kimi_k2")} == {"llamacpp"}


def test_a_truncated_tool_call_is_a_clean_error_and_the_node_serves_on(node: ExoNode) -> None:
    with pytest.raises(openai.APIError, match="tool call"):
        for _ in ask(node, TRUNCATED_MODEL_ID, stream=True):
            pass

    with pytest.raises(openai.UnprocessableEntityError, match="tool call") as raised:
        ask(node, TRUNCATED_MODEL_ID, stream=False)
    assert raised.value.status_code == 422
    assert raised.value.code == "invalid_model_output"

    # The same runner and the others go on serving.
    with pytest.raises(openai.APIError, match="tool call"):
        ask(node, TRUNCATED_MODEL_ID, stream=False)
    reasoning, content, tool_calls, finish_reasons = streamed_answer(node, model_id("qwen3"))
    assert_answer("qwen3", reasoning, content, tool_calls)
    assert finish_reasons == ["tool_calls"]


def test_qwen3_split_over_two_nodes_answers_the_same(tmp_path: Path, scripted_models_dir: Path) -> None:
    with loopback_cluster(2, tmp_path, {"EXO_MODELS_DIRS": str(scripted_models_dir)}) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        instance_id = place(nodes[0], model_id("qwen3"), "Pipeline", min_nodes=2)
        await_ready(nodes[0], instance_id)
        instance = nodes[0].state()["instances"][instance_id]
        assert len(instance["shardAssignments"]["nodeToRunner"]) == 2

        for entry in nodes:
            reasoning, content, tool_calls, finish_reasons = streamed_answer(entry, model_id("qwen3"))
            assert_answer("qwen3", reasoning, content, tool_calls)
            assert finish_reasons == ["tool_calls"]
        completion = ask(nodes[1], model_id("qwen3"), stream=False)
        message = completion.choices[0].message
        tool_calls = [(c.function.name, c.id, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        assert_answer("qwen3", message.model_extra["reasoning_content"], message.content or "", tool_calls)
        assert completion.choices[0].finish_reason == "tool_calls"
