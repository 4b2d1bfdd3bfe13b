"""Nodes joined over 127.0.0.1 by --bootstrap-peers alone (each has a discovery port of
its own, so multicast scouting cannot join them), and a late node catching up on the
cluster's history."""

import time
import uuid

import httpx

from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.node import ExoNode


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


def made_up_card() -> dict:
    return {
        "model_id": f"history/{uuid.uuid4().hex[:12]}",
        "n_layers": 4,
        "hidden_size": 256,
        "tasks": ["TextGeneration"],
        "storage_size": {"in_bytes": 1000},
    }


def wait_all(nodes: list[ExoNode], condition, what: str, timeout: float = 20) -> None:
    for node in nodes:
        node.wait_for_state(condition, timeout=timeout, what=what)


def emit_events(nodes: list[ExoNode], at_least: int, batch: int = 25, kept: int = 3) -> None:
    """Add and delete custom model cards through every node's API in turn until the
    cluster's history holds at_least events (an event each, and nothing else to do), then
    add `kept` more that stay."""
    clients = [httpx.Client(base_url=node.url, timeout=30) for node in nodes]
    try:
        while nodes[0].state()["lastEventAppliedIdx"] < at_least:
            ids = []
            for k in range(batch):
                card = made_up_card()
                response = clients[k % len(clients)].post("/models", json=card)
                assert response.status_code == 200, response.text
                ids.append(card["model_id"])
            wait_all(nodes, lambda s, ids=ids: set(ids) <= set(s["customModelCards"]), "cards added")
            for k, model_id in enumerate(ids):
                response = clients[k % len(clients)].delete(f"/models/{model_id}")
                assert response.status_code == 200, response.text
            wait_all(nodes, lambda s, ids=ids: not set(ids) & set(s["customModelCards"]), "cards deleted")
        ids = []
        for _ in range(kept):
            card = made_up_card()
            assert clients[0].post("/models", json=card).status_code == 200
            ids.append(card["model_id"])
        wait_all(nodes, lambda s: set(ids) <= set(s["customModelCards"]), "kept cards added")
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
        # And one real instance, with its runner's whole life in the history too.
        instance_id = nodes[1].place()
        before = wait_converged(nodes)
        assert before[0]["lastEventAppliedIdx"] >= 200
        assert len(before[0]["customModelCards"]) == 3
        assert list(before[0]["instances"]) == [instance_id]

        assert not (tmp_path / "node2").exists()  # the late node starts with no history at all
        late = nodes.add_node()
        assert late.home == tmp_path / "node2"
        states = wait_converged(nodes, timeout=40)

        first, *others = states
        for state in others:
            assert state["instances"] == first["instances"]
            assert state["customModelCards"] == first["customModelCards"]
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
