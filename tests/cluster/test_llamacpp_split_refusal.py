"""A llama.cpp split of a model llama.cpp refuses is placed again on MLX at once (issue
33 point 4).

Two real llama.cpp nodes, the tiny llama whose merge-less byte-level BPE llama.cpp will
not load (tests/node/test_llamacpp_refusal.py makes it), placed by hand as a 2-node
pipeline on llama.cpp: only rank 0 loads under llama.cpp, and one rank cannot change the
engine of a ring. Before, rank 0 recorded the refusal and failed three times, the
instance was deleted and auto-placement answered 503 for 300 s. Now the node reports
the refusal with the failure and the master places the same nodes and layers on MLX,
saying why; a request waiting for the instance is served by the new one."""

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.cluster.test_split_failure import failures
from tests.node.test_llamacpp_refusal import LLAMACPP_SAYS, MODEL, make_refused_model
from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.node import ExoNode, running_node

PROMPT = "a cluster of small nodes runs one model across its ranks; say what it does next"


def greedy(node: ExoNode) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def layers_by_node(instance: dict) -> dict[str, tuple[int, int]]:
    shards = instance["shardAssignments"]["runnerToShard"]
    return {
        node_id: (shards[runner_id]["startLayer"], shards[runner_id]["endLayer"])
        for node_id, runner_id in instance["shardAssignments"]["nodeToRunner"].items()
    }


def test_a_llamacpp_split_of_a_model_llamacpp_refuses_is_placed_again_on_mlx(tmp_path, tiny_models_dir):
    models = tmp_path / "models"
    make_refused_model(models, tiny_models_dir)
    env = {"EXO_MODELS_DIRS": str(models)}
    with running_node(tmp_path / "alone", env, models=(MODEL,)) as node:  # MLX, one node
        alone = greedy(node)

    with loopback_cluster(2, tmp_path, env, args=("--engine", "llamacpp")) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        body = {"model_id": MODEL, "sharding": "Pipeline", "min_nodes": 2}
        response = nodes[0].post("/place_instance", json=body)
        assert response.status_code == 200, response.text
        first_id = response.json()["instance_id"]
        state = nodes[0].wait_for_state(lambda s: first_id in s["instances"], timeout=30, what="placed")
        first = state["instances"][first_id]
        assert first["engine"] == "llamacpp"  # nothing refused it yet

        # Sent while the llama.cpp split loads: it waits for it, then for its successor.
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(greedy, nodes[1])
            assert answer.result(timeout=240) == alone and alone

        state = nodes[0].state()
        (instance,) = state["instances"].values()
        assert instance["engine"] == "mlx" and LLAMACPP_SAYS in instance["engineReason"], instance
        assert instance["engineReason"].startswith("runs on MLX: llama.cpp could not load the GGUF")
        assert layers_by_node(instance) == layers_by_node(first)
        assert LLAMACPP_SAYS in state["instanceDeletions"][first_id]
        refusals = [n for n, info in state["nodes"].items() if MODEL in info["llamacppRefusals"]]
        records = [record for n in nodes for record in (n.home / "cache" / "gguf").glob("*.refused")]
        assert len(refusals) == 1 and len(records) == 1, (refusals, records)
        events = nodes[0].get("/events").json()
        assert len(failures(events)) <= 1, failures(events)
        [preview, *_] = nodes[0].get("/instance/previews", params=body).json()
        assert preview["instance"]["engine"] == "mlx" and LLAMACPP_SAYS in preview["engineReason"], preview
