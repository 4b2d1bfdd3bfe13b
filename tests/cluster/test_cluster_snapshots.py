"""Snapshots in a real cluster (shared/history.py): with a snapshot every 20 events,
nodes that made a history of 120+ events hold only its tail, and a node that joins
late, needing events the master compacted away, takes the master's State instead and
serves."""

import openai

from tests.cluster.test_cluster_loopback import emit_events, models_env
from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.history import agree, held_events, snapshots_taken
from tests.support.node import TINY_MODEL_ID


def test_a_node_behind_the_masters_oldest_event_takes_its_snapshot(tmp_path, tiny_models_dir):
    env = {**models_env(tiny_models_dir), "EXO_SNAPSHOT_EVENTS": "20"}
    with loopback_cluster(2, tmp_path, env) as nodes:
        wait_converged(nodes)
        emit_events(list(nodes), at_least=120)
        instance_id = nodes[1].place()
        before = wait_converged(nodes)
        for node in nodes:
            held = held_events(node)
            assert len(snapshots_taken(node)) == 2 and 0 < min(held) <= before[0]["lastEventAppliedIdx"] - 19

        late = nodes.add_node()
        states = wait_converged(nodes, timeout=40)
        assert states[1] == states[0] and states[2] == states[0]
        assert instance_id in states[2]["instances"] and len(states[2]["customModelCards"]) == 3
        # It never had the compacted events: its history starts at the master's State.
        start = int(late.get("/events").headers["X-Exo-History-Start"])
        assert start > 0 and snapshots_taken(late) == [start - 1], (start, snapshots_taken(late))
        agree(held_events(late), held_events(nodes[0]))

        sdk = openai.OpenAI(base_url=f"{late.url}/v1", api_key="unused", max_retries=0, timeout=60)
        completion = sdk.chat.completions.create(
            model=TINY_MODEL_ID, messages=[{"role": "user", "content": "from the late node"}], max_tokens=4
        )
        assert completion.usage.completion_tokens > 0
