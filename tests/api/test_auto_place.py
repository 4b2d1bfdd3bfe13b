"""A request for a model with no instance places it (when auto-placement is on), waits
for it to load with keep-alive comments on streams, then answers."""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.api.placing import auto_place_enabled
from exo.shared.types.state import State
from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

HUGE_CARD = {
    "model_id": "custom/far-too-big",
    "n_layers": 4,
    "hidden_size": 256,
    "num_key_value_heads": 4,
    "tasks": ["TextGeneration"],
    "context_length": 2048,
    "storage_size": {"in_bytes": 2**50},
}


def chat(model: str = TINY_MODEL_ID, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": stream}


def wait_until_in_topology(node: ExoNode) -> None:
    node_id = node.get("/node_id").json()
    node.wait_for_state(lambda s: node_id in s["nodes"], what="this node in the topology")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    """One node, no flag: auto-placement is on because the cluster has one node."""
    with running_node(tmp_path_factory.mktemp("auto") / "exo_home", {"EXO_MODELS_DIRS": str(tiny_models_dir)}) as node:
        wait_until_in_topology(node)
        yield node


@pytest.fixture(scope="module")
def manual_node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    home = tmp_path_factory.mktemp("manual") / "exo_home"
    with running_node(home, {"EXO_MODELS_DIRS": str(tiny_models_dir)}, ("--no-auto-place",)) as node:
        wait_until_in_topology(node)
        yield node


def test_default_is_on_in_a_one_node_cluster_and_off_in_a_larger_one():
    def nodes(count: int) -> State:
        return State.model_construct(nodes={f"n{i}": None for i in range(count)})

    assert auto_place_enabled(None, nodes(1))
    assert not auto_place_enabled(None, nodes(2))
    assert auto_place_enabled(True, nodes(2))
    assert not auto_place_enabled(False, nodes(1))


def test_unknown_model_stays_a_404(node: ExoNode):
    response = node.post("/v1/chat/completions", json=chat("nobody/nothing"))
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert node.state()["instances"] == {}


def test_a_model_that_does_not_fit_is_a_400_with_the_placement_reason(node: ExoNode):
    assert node.post("/models", json=HUGE_CARD).status_code == 200
    node.wait_for_state(lambda s: HUGE_CARD["model_id"] in s["customModelCards"], what="the custom card")
    response = node.post("/v1/chat/completions", json=chat(HUGE_CARD["model_id"]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "placement_failed" and "GiB free" in error["message"]
    # The Claude API gives the same reason in its own error shape.
    claude = node.post(
        "/v1/messages", json={"model": HUGE_CARD["model_id"], "max_tokens": 8, "messages": chat()["messages"]}
    )
    assert claude.status_code == 400
    assert claude.json()["type"] == "error" and "GiB free" in claude.json()["error"]["message"]


def test_a_stream_places_the_model_sends_keepalives_while_it_loads_then_answers(node: ExoNode):
    assert node.state()["instances"] == {}
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=chat(stream=True), timeout=120) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    # Before any data: keep-alives while the model loads, then the prompt's prefill progress.
    keepalives = [line for line in lines[: lines.index("data: " + data[0])] if not line.startswith(": prefill")]
    # (A llama.cpp node converts the checkpoint first: quick for this model, unless the
    # machine is busy.)
    keepalive = r": (loading model \d+/\d+ layers|converting the weights for the engine \d+%|waiting)"
    assert keepalives and all(re.fullmatch(keepalive, c) for c in keepalives)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(node.state()["instances"]) == 1


def test_later_requests_use_the_placed_instance(node: ExoNode):
    instances = node.state()["instances"]
    response = node.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200, response.text
    assert node.state()["instances"].keys() == instances.keys()


def test_a_non_streaming_request_waits_for_the_model_it_places(node: ExoNode):
    for instance_id in node.state()["instances"]:
        assert node.delete(f"/instance/{instance_id}").status_code == 200
    node.wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, what="no instances")
    response = httpx.post(f"{node.url}/ollama/api/chat", json=chat() | {"stream": False}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["done"] is True
    assert len(node.state()["instances"]) == 1


def test_with_no_auto_place_a_model_without_instance_is_a_404(manual_node: ExoNode):
    response = manual_node.post("/v1/chat/completions", json=chat())
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_loaded"
    assert manual_node.state()["instances"] == {}
