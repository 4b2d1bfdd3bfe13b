"""Disaggregated serving on two real nodes (issue 36): POST /place_instance with a
prefill node and a decode node places the model whole on both; a long prompt asked of
the decode instance is prefilled on the other node, its KV streams to the decode node
sealed with the cluster secret, and the greedy answer is the one a single node gives,
for a plain KV cache (llama), sliding windows (Gemma 4's 16 tokens) and SSM state
(Qwen3-Next). The bench endpoint's generation_stats carry the transfer's bytes and
seconds; the same prompt again finds the decode node's prefix cache and moves nothing."""

import shutil

import httpx
import pytest

from exo.devtools.tiny_models import make_tiny
from tests.support.cluster import await_ready, loopback_cluster, wait_converged
from tests.support.node import TINY_MODEL_ID

FAMILIES = {TINY_MODEL_ID: None, "acme/tiny-gemma4": "gemma4_moe", "acme/tiny-qwen3-next": "qwen3_next"}

PROMPT = [{"role": "user", "content": "cluster node model token the cat runs over the quiet moon " * 12}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_models_dir):
    """The tiny llama, and tiny models of the families whose caches cannot be trimmed."""
    models = tmp_path_factory.mktemp("disaggregated_models")
    shutil.copytree(tiny_models_dir, models, dirs_exist_ok=True)
    for model_id, family in FAMILIES.items():
        if family is not None:
            make_tiny(models / model_id.replace("/", "--"), family)
    return models


@pytest.fixture
def two_nodes(tmp_path, models_dir):
    env = {"EXO_MODELS_DIRS": str(models_dir), "EXO_PREFILL_STEP": "16"}
    with loopback_cluster(2, tmp_path, env, args=("--cluster-secret", "kv handoff test secret")) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        yield nodes


def _bench(node, model_id: str) -> dict:
    body = {"model": model_id, "messages": PROMPT, "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{node.url}/bench/chat/completions", json=body, headers=node.headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _serving(state: dict, count: int) -> bool:
    runners = state["runners"]
    return len(state["instances"]) == count and all(
        runners.get(runner_id, {}).get("kind") in ("RunnerReady", "RunnerRunning")
        for instance in state["instances"].values()
        for runner_id in instance["shardAssignments"]["nodeToRunner"].values()
    )


def _await(node, response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    await_ready(node, instance_id)
    return instance_id


@pytest.mark.parametrize("model_id", list(FAMILIES))
def test_prefill_on_one_node_and_decode_on_the_other_answers_like_one_node(two_nodes, model_id):
    prefill_node, decode_node = two_nodes
    prefill_id, decode_id = prefill_node.node_id(), decode_node.node_id()
    body = {
        "model_id": model_id,
        "prefill_node_id": prefill_id,
        "decode_node_id": decode_id,
        "prefill_min_tokens": 32,
    }
    instance_id = _await(prefill_node, prefill_node.post("/place_instance", json=body))
    state = prefill_node.wait_for_state(lambda s: _serving(s, 2), timeout=120, what="both instances serving")
    decode = state["instances"][instance_id]
    assert list(decode["shardAssignments"]["nodeToRunner"]) == [decode_id]
    [prefill] = [i for i in state["instances"].values() if i["instanceId"] != instance_id]
    assert list(prefill["shardAssignments"]["nodeToRunner"]) == [prefill_id]
    assert prefill["prefillFor"]["instanceId"] == instance_id

    handed = _bench(prefill_node, model_id)  # asked through the prefill node's API: routed to the decode instance
    handoff = handed["generation_stats"]["kv_handoff"]
    print(f"{model_id}: KV handoff {handoff}, prompt {handed['usage']['prompt_tokens']} tokens")
    assert handoff is not None and handoff["bytes"] > 0 and handoff["seconds"] >= handoff["prefill_seconds"] > 0
    assert handoff["tokens"] == handed["usage"]["prompt_tokens"] - 1
    again = _bench(decode_node, model_id)
    assert again["generation_stats"]["kv_handoff"] is None  # the decode node's prefix cache holds it
    assert again["choices"][0]["message"]["content"] == handed["choices"][0]["message"]["content"]

    assert decode_node.delete(f"/instance/{instance_id}").status_code == 200
    decode_node.wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="both gone")
    _await(decode_node, decode_node.post("/place_instance", json={"model_id": model_id}))
    alone = _bench(decode_node, model_id)
    assert alone["generation_stats"]["kv_handoff"] is None
    assert handed["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert len(alone["choices"][0]["message"]["content"]) > 0
