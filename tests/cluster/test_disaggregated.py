"""Disaggregated serving on two real nodes (issue 36): POST /place_instance with a
prefill node and a decode node places the model whole on both; a long prompt asked of
the decode instance is prefilled on the other node, its KV streams to the decode node
sealed with the cluster secret, and the greedy answer is the one a single node gives.
Every family whose cache is plain positions (mlx-lm's KVCache, or DeepSeek's CacheList
of them) is placed in turn on one pair of nodes, and beside them sliding windows
(Gemma 4's 16 tokens), SSM state (Qwen3-Next) and DeepSeek V4's compressed caches. The
bench endpoint's generation_stats carry the transfer's bytes and seconds; the same
prompt again finds the decode node's prefix cache and moves nothing."""

import shutil

import httpx
import pytest

from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.devtools.tiny_models import make_tiny
from tests.support.cluster import await_ready, loopback_cluster, wait_converged
from tests.support.node import TINY_MODEL_ID

# The tiny families whose every layer's cache is a trimmable list of positions; the
# llama among them is the suite's own tiny model (TINY_MODEL_ID).
TRIMMABLE = [
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "kimi_k25",
    "minimax",
    "ministral3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
]
UNTRIMMABLE = ["gemma4_moe", "qwen3_next", "deepseek_v4"]
# Those with caches of the same kinds, handed off at the engine level only
# (tests/unit/test_kv_handoff.py covers every family).
ENGINE_LEVEL_ONLY = ["llama", "gemma4", "gpt_oss", "step3p5", "nemotron_h", "qwen3_5", "qwen3_5_moe"]
FAMILIES = {TINY_MODEL_ID: None} | {f"acme/tiny-{family}": family for family in TRIMMABLE + UNTRIMMABLE}

PROMPT = [{"role": "user", "content": "cluster node model token the cat runs over the quiet moon " * 12}]


def test_every_tiny_family_is_handed_off_here_or_at_the_engine_level():
    """A family added to the tiny configs is placed in one of the lists above."""
    listed = TRIMMABLE + UNTRIMMABLE + ENGINE_LEVEL_ONLY
    assert sorted(listed) == sorted(TINY_CONFIGS)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, tiny_models_dir):
    models = tmp_path_factory.mktemp("disaggregated_models")
    shutil.copytree(tiny_models_dir, models, dirs_exist_ok=True)
    for model_id, family in FAMILIES.items():
        if family is not None:
            make_tiny(models / model_id.replace("/", "--"), family)
    return models


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, models_dir):
    """One pair of nodes for every family: each test leaves the cluster empty."""
    env = {"EXO_MODELS_DIRS": str(models_dir), "EXO_PREFILL_STEP": "16"}
    home = tmp_path_factory.mktemp("disaggregated_cluster")
    with loopback_cluster(2, home, env, args=("--cluster-secret", "kv handoff test secret")) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        yield nodes


@pytest.fixture
def pair(two_nodes):
    """The two nodes, emptied of instances after the test, whatever became of it."""
    yield two_nodes
    node = two_nodes[0]
    for instance_id in node.state()["instances"]:
        node.delete(f"/instance/{instance_id}")
    node.wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="instances gone")


def _bench(node, model_id: str, messages: list[dict] = PROMPT) -> dict:
    body = {"model": model_id, "messages": messages, "max_tokens": 24, "temperature": 0}
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
def test_prefill_on_one_node_and_decode_on_the_other_answers_like_one_node(pair, model_id):
    prefill_node, decode_node = pair
    instance_id = _place_disaggregated(pair, model_id)

    handed = _bench(prefill_node, model_id)  # asked through the prefill node's API: routed to the decode instance
    handoff = handed["generation_stats"]["kv_handoff"]
    print(f"{model_id}: KV handoff {handoff}, prompt {handed['usage']['prompt_tokens']} tokens")
    assert handoff is not None and handoff["bytes"] > 0 and handoff["seconds"] >= handoff["prefill_seconds"] > 0
    assert handoff["tokens"] == handed["usage"]["prompt_tokens"] - 1
    again = _bench(decode_node, model_id)
    assert again["generation_stats"]["kv_handoff"] is None  # the decode node's prefix cache holds it
    assert _answer(again) == _answer(handed)

    _delete(decode_node, instance_id)
    alone = _alone(decode_node, model_id, PROMPT)
    assert _answer(handed) == _answer(alone)
    assert alone["usage"]["completion_tokens"] > 1


def test_a_turn_the_decode_node_answered_itself_is_offered_to_the_prefill_node(pair):
    """A first turn too short to hand off is prefilled and answered on the decode node;
    the next turn, long enough, is prefilled on the other node from where the decode
    node's cache ends, that prefix sent there first, and answers as one node does."""
    prefill_node, decode_node = pair
    instance_id = _place_disaggregated(pair, TINY_MODEL_ID)
    short = [{"role": "user", "content": "the cat"}]
    first = _bench(decode_node, TINY_MODEL_ID, short)
    assert first["generation_stats"]["kv_handoff"] is None  # fewer than 32 tokens
    turn = [*short, {"role": "assistant", "content": _answer(first)["content"]}, *PROMPT]
    handed = _bench(prefill_node, TINY_MODEL_ID, turn)
    handoff = handed["generation_stats"]["kv_handoff"]
    print(f"KV handoff {handoff}, prompt {handed['usage']['prompt_tokens']} tokens")
    assert handoff is not None and handoff["offered_tokens"] > 0
    assert handoff["offered_tokens"] + handoff["tokens"] == handed["usage"]["prompt_tokens"] - 1

    _delete(decode_node, instance_id)
    assert _answer(handed) == _answer(_alone(decode_node, TINY_MODEL_ID, turn))


def _place_disaggregated(pair, model_id: str) -> str:
    """The model placed to prefill on the first node and decode on the second; the
    decode instance's id."""
    prefill_node, decode_node = pair
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
    return instance_id


def _alone(node, model_id: str, messages: list[dict]) -> dict:
    """The answer of the model placed on `node` alone (then deleted)."""
    instance_id = _await(node, node.post("/place_instance", json={"model_id": model_id}))
    alone = _bench(node, model_id, messages)
    _delete(node, instance_id)
    assert alone["generation_stats"]["kv_handoff"] is None
    return alone


def _answer(response: dict) -> dict:
    """The message, its thinking included (DeepSeek's templates open a think block)."""
    return response["choices"][0]["message"]


def _delete(node, instance_id: str) -> None:
    assert node.delete(f"/instance/{instance_id}").status_code == 200
    node.wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="instances gone")
