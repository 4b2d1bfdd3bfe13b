"""--cluster-secret on real nodes over loopback: two nodes given the same secret (and
different API keys) form a cluster, measure their links through each other's keyed API
and serve a chat across nodes; a node with another secret and one with none, both
bootstrapped at the cluster and started with --force-master, never appear in its State,
see none of it, and what they publish (heartbeats claiming the master, a placement) is
not accepted. A capture of loopback during the chat finds the prompt on the client's
HTTP connection only, never on the cluster transport's connections, nor on a split
instance's MLX ring; and peer downloads pass the peers' keyed APIs."""

import time
import uuid

import httpx
import pytest

from exo.routing.seal import MAGIC, peer_token
from exo.worker.download import hub
from tests.cluster.test_shard_downloads import MODEL_ID as LAYERED_MODEL
from tests.cluster.test_shard_downloads import make_layered_model, place_ready
from tests.support.capture import capture_unavailable_reason, loopback_capture
from tests.support.cluster import ClusterNode, loopback_cluster, wait_converged
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)
from tests.support.node import TINY_MODEL_ID

PROMPT = f"the purple elephant negotiates at midnight {uuid.uuid4().hex[:8]}"
# Heartbeats go out every 0.5 s: an outsider that could join would have within this.
OUTSIDER_SECONDS = 8


def runs_on(state: dict, instance_id: str) -> set[str]:
    return set(state["instances"][instance_id]["shardAssignments"]["nodeToRunner"])


def links(state: dict) -> set[tuple[str, str]]:
    return {(c["source"], c["sink"]) for c in state["topology"]["connections"]}


def test_only_nodes_with_the_secret_join_and_nothing_crosses_in_clear(tmp_path, tiny_models_dir, monkeypatch):
    reason = capture_unavailable_reason()
    if reason is not None:
        pytest.fail(f"this test captures loopback packets: {reason}")
    secret = uuid.uuid4().hex
    keys = [f"key-a-{uuid.uuid4().hex}", f"key-b-{uuid.uuid4().hex}"]
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir)}
    with loopback_cluster(1, tmp_path, env, args=("--cluster-secret", secret, "--api-key", keys[0])) as cluster:
        cluster.add_node(args=("--cluster-secret", secret, "--api-key", keys[1]))
        members: list[ClusterNode] = list(cluster)
        for node, key in zip(members, keys, strict=True):
            node.api_key = key
        states = wait_converged(members)
        ids = {node.node_id() for node in members}
        master = states[0]["masterNodeId"]

        # Links are measured through the peers' keyed APIs with the token from the secret.
        deadline = time.monotonic() + 30
        while links(members[0].state()) != {(a, b) for a in ids for b in ids if a != b}:
            assert time.monotonic() < deadline, f"links not measured: {members[0].state()['topology']}"
            time.sleep(0.5)
        token = peer_token(secret)
        peer_listing = f"{members[1].url}/peer-hub/api/models/{TINY_MODEL_ID}/revision/main"
        monkeypatch.setenv("HF_TOKEN", "hf_this_must_not_reach_a_peer")
        with hub.client(token) as http:
            assert http.get(peer_listing).status_code in (200, 404)  # past the key check
            assert http.get(f"{members[1].url}/state").status_code == 401  # the token opens peer paths only
        with hub.client(None) as http:
            refused = http.get(peer_listing)
            # The downloader's HF_TOKEN was not sent to the peer: no key at all was presented.
            assert refused.status_code == 401 and "needs an API key" in refused.text

        instance_id = members[0].place(TINY_MODEL_ID)
        [runner_node] = runs_on(members[0].state(), instance_id)
        client_node = next(node for node in members if node.node_id() != runner_node)

        other = cluster.add_node(args=("--cluster-secret", "another-secret", "--force-master"))
        plain = cluster.add_node(args=("--force-master",))
        outsiders = [other, plain]
        time.sleep(OUTSIDER_SECONDS)

        after = wait_converged(members)
        for state in after:
            assert set(state["nodes"]) == ids and state["masterNodeId"] == master
            assert set(state["instances"]) == {instance_id}
        for outsider in outsiders:
            own = outsider.node_id()
            seen = outsider.state()
            assert set(seen["nodes"]) <= {own} and seen["masterNodeId"] in (own, None), seen["nodes"]
            assert not seen["instances"] and not set(seen["downloads"]) & ids
        # An outsider's own placement is accepted by its own master only.
        plain.wait_for_state(lambda s: plain.node_id() in s["nodes"], what="the outsider in its own topology")
        response = plain.post("/place_instance", json={"model_id": TINY_MODEL_ID})
        assert response.status_code == 200, response.text
        foreign_instance = response.json()["instance_id"]
        plain.wait_for_state(lambda s: foreign_instance in s["instances"], what="the outsider's own instance")

        transport_ports = [node.listen_port for node in cluster]
        with loopback_capture([*transport_ports, client_node.api_port]) as capture:
            body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
            chat = httpx.post(
                f"{client_node.url}/v1/chat/completions", json=body, headers=client_node.headers, timeout=60
            )
            assert chat.status_code == 200, chat.text
            time.sleep(1)
        reply = chat.json()["choices"][0]["message"]["content"]
        transport = capture.streams(transport_ports)
        assert sum(len(s) for s in transport) > 1000 and any(MAGIC in s for s in transport)
        assert not any(PROMPT.encode() in s for s in transport)
        if len(reply) >= 8:
            assert not any(reply.encode() in s for s in transport)
        # The control: the capture does see the prompt where it travels in clear.
        assert any(PROMPT.encode() in s for s in capture.streams([client_node.api_port]))

        for state in wait_converged(members):
            assert set(state["instances"]) == {instance_id} and set(state["nodes"]) == ids
        member_logs = "".join(node.logs() for node in members)
        assert "not sealed (a node without a cluster secret?)" in member_logs
        assert "does not authenticate (a node with another cluster secret?)" in member_logs
        assert "dropping unreadable" in plain.logs()
        for node in cluster:
            assert secret not in node.logs() and all(key not in node.logs() for key in keys)


def test_a_split_instance_carries_no_prompt_in_clear_between_its_ranks(tmp_path, tiny_models_dir):
    """Rank 0 sends each request's start op (its messages) to the other ranks over the
    MLX ring; with a secret those bytes are sealed too (engine/mlx/parallel.py). The nodes
    run llama.cpp, whose RPC port has no authentication: under the secret the split runs
    on MLX, and the placement preview says why."""
    reason = capture_unavailable_reason()
    if reason is not None:
        pytest.fail(f"this test captures loopback packets: {reason}")
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_CLUSTER_SECRET": uuid.uuid4().hex}
    with loopback_cluster(2, tmp_path, env, args=("--engine", "llamacpp")) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        previews = (
            nodes[0]
            .get("/instance/previews", params={"model_id": TINY_MODEL_ID, "sharding": "Pipeline", "min_nodes": 2})
            .json()
        )
        split = next(p for p in previews if p["instance"] is not None and len(p["nodeIds"]) == 2)
        assert split["instance"]["engine"] == "mlx" and "unauthenticated" in split["engineReason"], split
        response = nodes[0].post(
            "/place_instance", json={"model_id": TINY_MODEL_ID, "sharding": "Pipeline", "min_nodes": 2}
        )
        assert response.status_code == 200, response.text
        instance_id = response.json()["instance_id"]
        with httpx.stream(
            "GET", f"{nodes[0].url}/instance/await", params={"instance_id": instance_id}, timeout=180
        ) as stream:
            assert "event: ready" in [line for line in stream.iter_lines() if line.startswith("event:")]
        instance = nodes[0].state()["instances"][instance_id]
        assert instance["engine"] == "mlx", instance
        hosts = instance["hosts"]
        ring_ports = [int(host.rsplit(":", 1)[1]) for host in hosts]
        transport_ports = [node.listen_port for node in nodes]
        with loopback_capture([*ring_ports, *transport_ports]) as capture:
            body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
            chat = httpx.post(f"{nodes[1].url}/v1/chat/completions", json=body, timeout=120)
            assert chat.status_code == 200, chat.text
            time.sleep(1)
        ring = capture.streams(ring_ports)
        assert sum(len(s) for s in ring) > 1000, "no ring traffic captured"
        # The ring's all-sum carries each byte as an int32: look for the prompt that way too.
        widened = b"".join(bytes([c, 0, 0, 0]) for c in PROMPT.encode())
        assert not any(PROMPT.encode() in s or widened in s for s in ring)
        assert not any(PROMPT.encode() in s for s in capture.streams(transport_ports))


def test_nodes_with_a_secret_and_their_own_keys_take_files_from_each_other(fake_hub, tmp_path):
    """A peer download goes through the other node's keyed /peer-hub with the token from
    the secret: two nodes, each with its own API key, the hub stopped once each holds its
    half of a pipeline; the node then placed alone takes the other half from its peer."""
    endpoint, root = fake_hub
    make_layered_model(root / "acme--layered")
    secret = uuid.uuid4().hex
    keys = [f"key-a-{uuid.uuid4().hex}", f"key-b-{uuid.uuid4().hex}"]
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1", "EXO_CLUSTER_SECRET": secret}
    with loopback_cluster(1, tmp_path, env, args=("--api-key", keys[0]), offline=False) as nodes:
        nodes.add_node(args=("--api-key", keys[1]))
        for node, key in zip(nodes, keys, strict=True):
            node.api_key = key
        wait_converged(nodes, timeout=60)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=60, what="links")
        assert nodes[0].post("/models/add", json={"model_id": LAYERED_MODEL}).status_code == 200
        instance_id = place_ready(nodes, min_nodes=2)
        assert nodes[0].delete(f"/instance/{instance_id}").status_code == 200
        nodes[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="gone")
        fake_hub.stop()

        instance_id = place_ready(nodes, min_nodes=1)
        (node_id,) = nodes[0].state()["instances"][instance_id]["shardAssignments"]["nodeToRunner"]
        node = next(n for n in nodes if n.node_id() == node_id)
        assert f"of {LAYERED_MODEL} from peer http://127.0.0.1:" in node.logs()
        chat = httpx.post(
            f"{node.url}/v1/chat/completions",
            json={"model": LAYERED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers=node.headers,
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
