"""Bad input gets a 4xx in OpenAI's error shape, never a 5xx, and the node stays up."""

import openai
import pytest

from tests.support.node import TINY_MODEL_ID, ExoNode, start_node, stop_node


def assert_openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert {"param", "code"} <= error.keys()
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"model": TINY_MODEL_ID, "messages": "hi"}, "messages"),
        ({"model": TINY_MODEL_ID, "messages": []}, "messages"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            "temperature",
        ),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "stream": "yes please"}, "stream"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "n": 3}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ],
)
def test_malformed_chat_request_is_a_400(exo_node: ExoNode, body: dict, param: str):
    error = assert_openai_error(exo_node.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param


def test_bad_json_is_a_400(exo_node: ExoNode):
    response = exo_node.post(
        "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}
    )
    error = assert_openai_error(response, 400)
    assert "JSON" in error["message"]


def test_unknown_model_is_a_404_through_the_sdk(exo_node: ExoNode):
    sdk = openai.OpenAI(base_url=f"{exo_node.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        sdk.chat.completions.create(model="nobody/nothing", messages=[{"role": "user", "content": "hi"}])
    assert "nobody/nothing" in raised.value.message


def test_known_model_without_instance_is_a_404_that_says_what_to_do(tmp_path, tiny_models_dir):
    # With auto-placement on (a lone node's default) the model would be placed instead.
    node = start_node(tmp_path / "home", {"EXO_MODELS_DIRS": str(tiny_models_dir)}, args=("--no-auto-place",))
    try:
        response = node.post(
            "/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
        )
        error = assert_openai_error(response, 404)
        assert "place" in error["message"]
    finally:
        stop_node(node)


def test_cluster_endpoints_reject_bad_input(exo_node: ExoNode):
    assert_openai_error(exo_node.post("/place_instance", json={"model_id": "nobody/nothing"}), 404)
    assert_openai_error(exo_node.post("/place_instance", json={"model_id": TINY_MODEL_ID, "sharding": "Diagonal"}), 400)
    assert_openai_error(exo_node.post("/place_instance", json={}), 400)
    assert_openai_error(exo_node.post("/instance", json={"instance": {"nonsense": True}}), 400)
    assert_openai_error(exo_node.get("/instance/does-not-exist"), 404)
    assert_openai_error(exo_node.delete("/instance/does-not-exist"), 404)
    assert_openai_error(exo_node.get("/instance/previews"), 400)
    assert_openai_error(exo_node.get("/no/such/route"), 404)


def test_node_still_serves_after_bad_requests(exo_node: ExoNode):
    for _ in range(3):
        exo_node.post("/v1/chat/completions", content=b"garbage", headers={"content-type": "application/json"})
    exo_node.place()
    sdk = openai.OpenAI(base_url=f"{exo_node.url}/v1", api_key="unused", max_retries=0)
    completion = sdk.chat.completions.create(
        model=TINY_MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.usage.completion_tokens > 0


PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def test_images_are_refused_in_each_apis_own_error_shape_not_dropped(exo_node: ExoNode):
    # A text-only model refuses images: an image must not vanish from the prompt.
    exo_node.place()
    image_url = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}
    openai_body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image_url]}],
    }
    error = assert_openai_error(exo_node.post("/v1/chat/completions", json=openai_body), 400)
    assert error["code"] == "unsupported_content" and "takes text only" in error["message"]

    claude_image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}}
    claude = exo_node.post(
        "/v1/messages",
        json={"model": TINY_MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": [claude_image]}]},
    )
    assert claude.status_code == 400
    assert claude.json()["type"] == "error" and "image_url" in claude.json()["error"]["message"]

    ollama = exo_node.post(
        "/ollama/api/chat",
        json={
            "model": TINY_MODEL_ID,
            "stream": False,
            "messages": [{"role": "user", "content": "hi", "images": [PIXEL]}],
        },
    )
    assert ollama.status_code == 400 and "takes text only" in ollama.json()["error"]

    # A card that says it sees images has them checked: bytes that are no image are a 400.
    card = {
        "model_id": "custom/seeing",
        "n_layers": 4,
        "hidden_size": 256,
        "tasks": ["TextGeneration"],
        "capabilities": ["text", "vision"],
        "storage_size": {"in_bytes": 1000},
    }
    assert exo_node.post("/models", json=card).status_code == 200
    exo_node.wait_for_state(lambda s: "custom/seeing" in s["customModelCards"], what="card added")
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    seeing_body = {"model": "custom/seeing", "messages": [{"role": "user", "content": [broken]}]}
    error = assert_openai_error(exo_node.post("/v1/chat/completions", json=seeing_body), 400)
    assert error["code"] == "invalid_image" and "image 1 could not be decoded" in error["message"]

    # Text still works.
    sdk = openai.OpenAI(base_url=f"{exo_node.url}/v1", api_key="unused", max_retries=0)
    completion = sdk.chat.completions.create(
        model=TINY_MODEL_ID, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=4
    )
    assert completion.usage.completion_tokens > 0


def test_a_hand_built_instance_that_cannot_run_is_a_400_and_creates_nothing(exo_node: ExoNode):
    node_id = exo_node.node_id()
    exo_node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
    planned = exo_node.get("/instance/placement", params={"model_id": TINY_MODEL_ID}).json()
    [runner] = planned["shardAssignments"]["nodeToRunner"].values()

    ghost = {**planned, "shardAssignments": {**planned["shardAssignments"], "nodeToRunner": {"ghost": runner}}}
    error = assert_openai_error(exo_node.post("/instance", json={"instance": ghost}), 400)
    assert error["code"] == "invalid_instance" and "ghost are not in the cluster" in error["message"]

    shards = {
        runner_id: {**shard, "nLayers": 60, "endLayer": 60}
        for runner_id, shard in planned["shardAssignments"]["runnerToShard"].items()
    }
    too_deep = {**planned, "shardAssignments": {**planned["shardAssignments"], "runnerToShard": shards}}
    error = assert_openai_error(exo_node.post("/instance", json={"instance": too_deep}), 400)
    assert "layers, but the shards say 60" in error["message"]

    assert exo_node.state()["instances"] == {}
    assert exo_node.post("/instance", json={"instance": planned}).status_code == 200
    exo_node.wait_for_state(lambda s: planned["instanceId"] in s["instances"], what="the valid one created")
