"""Every node of a cluster killed -9 at once, then started again on the same homes and
ports: what the cluster knew comes back from each node's durable history (its newest
snapshot of State and the events after it, docs/ARCHITECTURE.md): the custom card, the
download records, the split instance, which serves again; no node's history loses or
repeats an event. Snapshots are taken every few events here, so the nodes restart from one."""

import openai

from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.history import agree, held_events, snapshots_taken
from tests.support.node import TINY_MODEL_ID, free_port

# Small, so several snapshots are taken (and old events compacted) before the restart.
SNAPSHOT_EVERY = {"EXO_SNAPSHOT_EVENTS": "15"}

CUSTOM_CARD = {
    "model_id": "acme/custom",
    "n_layers": 2,
    "hidden_size": 64,
    "tasks": ["TextGeneration"],
    "context_length": 4096,
    "storage_size": {"in_bytes": 500000},
}
PROMPT = [{"role": "user", "content": "Hello there, tell me about clusters"}]


def greedy(node) -> str:
    sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = sdk.chat.completions.create(model=TINY_MODEL_ID, messages=PROMPT, max_tokens=12, temperature=0)
    return completion.choices[0].message.content or ""


def serving(state: dict, instance_id: str) -> bool:
    instance = state["instances"].get(instance_id)
    return instance is not None and all(
        state["runners"].get(r, {}).get("kind") == "RunnerReady" for r in instance["shardAssignments"]["runnerToShard"]
    )


def test_every_node_killed_and_restarted_gets_cards_downloads_and_instances_back(tmp_path, tiny_models_dir):
    with loopback_cluster(2, tmp_path, {"EXO_MODELS_DIRS": str(tiny_models_dir), **SNAPSHOT_EVERY}) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        assert nodes[0].post("/models", json=CUSTOM_CARD).status_code == 200
        body = {"model_id": TINY_MODEL_ID, "sharding": "Pipeline", "min_nodes": 2}
        instance_id = nodes[0].post("/place_instance", json=body).json()["instance_id"]
        before = nodes[1].wait_for_state(lambda s: serving(s, instance_id), timeout=120, what="instance serving")
        answer = greedy(nodes[1])
        node_ids = sorted(before["nodes"])
        downloads = {n: before["downloads"][n][TINY_MODEL_ID]["kind"] for n in node_ids}
        assert downloads == dict.fromkeys(node_ids, "DownloadCompleted")
        logs_before = [held_events(node) for node in nodes]
        for node, log in zip(nodes, logs_before, strict=True):
            # The card's event was compacted away: it comes back from a snapshot.
            assert len(snapshots_taken(node)) == 2 and min(log) > 0, (snapshots_taken(node), min(log))
        for node in nodes:
            # They restart from their snapshots, then keep what they write afterwards
            # (the statuses checked below) uncompacted.
            node.env = {**(node.env or {}), "EXO_SNAPSHOT_EVENTS": "100000"}

        nodes.kill_and_restart(list(nodes))

        wait_converged(nodes, timeout=60)
        after = nodes[1].wait_for_state(lambda s: serving(s, instance_id), timeout=120, what="instance back")
        assert "acme/custom" in after["customModelCards"]
        assert sorted(after["nodes"]) == node_ids
        assert {n: after["downloads"][n][TINY_MODEL_ID]["kind"] for n in node_ids} == downloads
        assert greedy(nodes[1]) == answer
        for node, log_before in zip(nodes, logs_before, strict=True):
            log_after = held_events(node)  # no gap, none twice
            # Each node's history continues its own: nothing lost, nothing applied twice.
            assert max(log_after) > max(log_before)
            agree(log_before, log_after)
        # And both nodes hold the same history.
        first, second = (held_events(node) for node in nodes)
        # Each restarted worker first says its runner's old status is gone, so no rank
        # connects or loads on the other's pre-restart "ready".
        for runner_id in before["instances"][instance_id]["shardAssignments"]["nodeToRunner"].values():
            statuses = [
                e["event"]["status"]["kind"]
                for idx, e in sorted(first.items())
                if idx > max(logs_before[0])
                and e["event"]["kind"] == "RunnerStatusUpdated"
                and e["event"]["runnerId"] == runner_id
            ]
            first_idle = statuses.index("RunnerIdle")
            assert first_idle > 0 and set(statuses[:first_idle]) == {"RunnerShutdown"}, statuses
        assert agree(first, second) > 0 and max(first.keys() & second.keys()) > max(logs_before[0])


def test_a_node_restarted_on_another_api_port_is_reached_there(tmp_path):
    """Its event log knows it with the old port; it must say so again, or the other
    node's link probes (and a split's placement) keep knocking at the old one."""
    with loopback_cluster(2, tmp_path) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        moved_id = nodes[1].get("/node_id").json()
        new_port = free_port()
        nodes.kill_and_restart([nodes[1]], api_ports=[new_port])

        def reached_again(state: dict) -> bool:
            known = state["nodes"].get(moved_id, {})
            links = {(c["source"], c["sink"]) for c in state["topology"]["connections"]}
            return known.get("apiPort") == new_port and len(links) == 2

        nodes[0].wait_for_state(reached_again, timeout=60, what="the new port known and both links measured")
