"""Nodes joined over 127.0.0.1 by --bootstrap-peers alone (each has a discovery port of
its own, so multicast scouting cannot join them), and a late node catching up on the
cluster's history."""

import time
import uuid

import httpx

from cluster import loopback_cluster, wait_converged
from conftest import TINY_MODEL_ID, ExoNode

# Instances are placed on this node, which no cluster has: no worker starts runners for
# them, so creating and deleting one costs the cluster an event each and nothing more.
GHOST_NODE = "ghost-node-not-in-any-cluster"


def models_env(tiny_models_dir) -> dict[str, str]:
    return {"EXO_MODELS_DIRS": str(tiny_models_dir)}


def test_three_nodes_joined_by_bootstrap_peers_converge(tmp_path, tiny_models_dir):
    with loopback_cluster(3, tmp_path, models_env(tiny_models_dir)) as nodes:
        assert len({node.discovery_port for node in nodes}) == 3
        assert "--bootstrap-peers" not in nodes[0].process.args
        for index, node in enumerate(nodes[1:], start=1):
            peers = node.process.args[node.process.args.index("--bootstrap-peers") + 1]
            assert peers == ",".join(f"tcp/127.0.0.1:{n.listen_port}" for n in nodes[:index])

        states = wait_converged(nodes)

        ids = {node.node_id() for node in nodes}
        assert len(ids) == 3
        assert all(set(state["nodes"]) == ids for state in states)
        assert len({state["masterNodeId"] for state in states}) == 1 and states[0]["masterNodeId"] in ids
        assert len({state["lastEventAppliedIdx"] for state in states}) == 1
        assert states[1] == states[0] and states[2] == states[0]


def ghost_instance(card: dict) -> dict:
    runner_id = str(uuid.uuid4())
    shard = {
        "kind": "pipeline",
        "modelCard": card,
        "deviceRank": 0,
        "worldSize": 1,
        "startLayer": 0,
        "endLayer": card["n_layers"],
        "nLayers": card["n_layers"],
    }
    return {
        "instanceId": str(uuid.uuid4()),
        "sharding": "Pipeline",
        "shardAssignments": {
            "modelId": card["model_id"],
            "runnerToShard": {runner_id: shard},
            "nodeToRunner": {GHOST_NODE: runner_id},
        },
    }


def wait_all(nodes: list[ExoNode], condition, what: str, timeout: float = 20) -> None:
    for node in nodes:
        node.wait_for_state(condition, timeout=timeout, what=what)


def emit_events(nodes: list[ExoNode], at_least: int, batch: int = 25, kept: int = 3) -> None:
    """Create and delete ghost instances through every node's API in turn until the
    cluster's history holds at_least events, then create `kept` more that stay."""
    card = next(c for c in nodes[0].get("/models").json() if c["model_id"] == TINY_MODEL_ID)
    clients = [httpx.Client(base_url=node.url, timeout=30) for node in nodes]
    try:
        while nodes[0].state()["lastEventAppliedIdx"] < at_least:
            instances = [ghost_instance(card) for _ in range(batch)]
            for k, instance in enumerate(instances):
                response = clients[k % len(clients)].post("/instance", json={"instance": instance})
                assert response.status_code == 200, response.text
            ids = {i["instanceId"] for i in instances}
            wait_all(nodes, lambda s, ids=ids: ids <= set(s["instances"]), "ghost instances created")
            for k, instance_id in enumerate(ids):
                response = clients[k % len(clients)].delete(f"/instance/{instance_id}")
                assert response.status_code == 200, response.text
            wait_all(nodes, lambda s, ids=ids: not ids & set(s["instances"]), "ghost instances deleted")
        instances = [ghost_instance(card) for _ in range(kept)]
        for instance in instances:
            assert clients[0].post("/instance", json={"instance": instance}).status_code == 200
        ids = {i["instanceId"] for i in instances}
        wait_all(nodes, lambda s: ids <= set(s["instances"]), "kept ghost instances created")
    finally:
        for client in clients:
            client.close()


def test_a_node_started_after_200_events_catches_up_to_the_same_state(tmp_path, tiny_models_dir):
    # Two nodes make the history, a third joins late: no more than three exo processes at once.
    with loopback_cluster(2, tmp_path, models_env(tiny_models_dir)) as nodes:
        wait_converged(nodes)
        started = time.monotonic()
        emit_events(list(nodes), at_least=200)
        print(f"emitted {nodes[0].state()['lastEventAppliedIdx']} events in {time.monotonic() - started:.1f}s")
        before = wait_converged(nodes)
        assert before[0]["lastEventAppliedIdx"] >= 200
        assert len(before[0]["instances"]) == 3

        assert not (tmp_path / "node2").exists()  # the late node starts with no history at all
        late = nodes.add_node()
        assert late.home == tmp_path / "node2"
        states = wait_converged(nodes, timeout=40)

        first, *others = states
        for state in others:
            assert state["instances"] == first["instances"]
            assert set(state["nodes"]) == set(first["nodes"])
            assert state["lastEventAppliedIdx"] == first["lastEventAppliedIdx"]
            assert state["masterNodeId"] == first["masterNodeId"]
            assert state == first  # State is a function of the history: all of it agrees
        assert first["masterNodeId"] == before[0]["masterNodeId"]  # the newcomer took nothing over
        assert set(first["instances"]) == set(before[0]["instances"])
        # The late node keeps the whole history, not just the State it builds.
        late_history = late.get("/events").json()
        assert [event["idx"] for event in late_history] == list(range(len(late_history)))  # from idx 0
        assert len(late_history) > first["lastEventAppliedIdx"]
        assert late_history == nodes[0].get("/events").json()[: len(late_history)]
