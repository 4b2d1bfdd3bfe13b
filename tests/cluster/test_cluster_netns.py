"""Nodes in separate Linux network namespaces on one bridge: they find each other by UDP
multicast scouting alone (no bootstrap peers), and --namespace keeps clusters apart."""

import time
import uuid

from tests.support.cluster import describe, netns_cluster, wait_converged


def models_env(tiny_models_dir) -> dict[str, str]:
    return {"EXO_MODELS_DIRS": str(tiny_models_dir)}


def test_three_nodes_find_each_other_by_multicast_alone(tmp_path, tiny_models_dir):
    with netns_cluster(3, tmp_path, models_env(tiny_models_dir)) as nodes:
        assert not any("--bootstrap-peers" in node.process.args for node in nodes)
        assert len({node.netns for node in nodes}) == 3 and len({node.host for node in nodes}) == 3
        assert len({node.discovery_port for node in nodes}) == 1

        states = wait_converged(nodes, timeout=40)

        ids = {node.node_id() for node in nodes}
        assert len(ids) == 3
        assert all(set(state["nodes"]) == ids for state in states)
        assert len({state["masterNodeId"] for state in states}) == 1 and states[0]["masterNodeId"] in ids
        assert len({state["lastEventAppliedIdx"] for state in states}) == 1
        assert states[1] == states[0] and states[2] == states[0]


def test_a_node_of_another_namespace_on_the_same_bridge_does_not_join(tmp_path, tiny_models_dir):
    # No more than three exo processes at once on this machine: a cluster of two, then the stranger.
    cluster_namespace = f"blue-{uuid.uuid4().hex[:8]}"
    with netns_cluster(2, tmp_path, models_env(tiny_models_dir), namespaces=[cluster_namespace] * 2) as nodes:
        before = wait_converged(nodes, timeout=40)
        ids = {node.node_id() for node in nodes}
        master = before[0]["masterNodeId"]
        members = list(nodes)

        stranger = nodes.add_node(namespace=f"red-{uuid.uuid4().hex[:8]}")
        assert stranger.discovery_port == nodes[0].discovery_port
        assert "--bootstrap-peers" not in stranger.process.args
        stranger_id = stranger.node_id()
        alone = wait_converged([stranger], timeout=30)[0]
        assert set(alone["nodes"]) == {stranger_id} and alone["masterNodeId"] == stranger_id

        # Long enough for heartbeats (0.5 s), an election debounce (1.5 s) and a node
        # info report to cross over, were the namespaces not kept apart.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            states = [node.state() for node in members]
            stranger_state = stranger.state()
            assert all(set(state["nodes"]) == ids for state in states), describe(members, states)
            assert all(state["masterNodeId"] == master for state in states), describe(members, states)
            assert set(stranger_state["nodes"]) == {stranger_id}, describe([stranger], [stranger_state])
            assert stranger_state["masterNodeId"] == stranger_id
            time.sleep(0.25)
        assert stranger_id not in ids
        wait_converged(members)
