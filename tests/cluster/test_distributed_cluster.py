"""Instances split over two real nodes (pipeline and tensor, over the MLX ring) serve
through the API like a single-node instance."""

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from exo.devtools.tiny_models import make_tiny_llama
from tests.support.cluster import await_ready, loopback_cluster, netns_cluster, wait_converged
from tests.support.node import TINY_MODEL_ID

PROMPT = [{"role": "user", "content": "Hello there, tell me about clusters"}]


def place_and_wait(node, sharding: str, min_nodes: int, **extra) -> str:
    response = node.post(
        "/place_instance", json={"model_id": TINY_MODEL_ID, "sharding": sharding, "min_nodes": min_nodes, **extra}
    )
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    await_ready(node, instance_id)
    return instance_id


def delete_and_wait(node, instance_id: str) -> None:
    assert node.delete(f"/instance/{instance_id}").status_code == 200
    node.wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="instance gone")


def greedy(node, max_tokens: int = 24) -> str:
    sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = sdk.chat.completions.create(model=TINY_MODEL_ID, messages=PROMPT, max_tokens=max_tokens, temperature=0)
    return completion.choices[0].message.content


@pytest.fixture
def two_nodes(tmp_path, tiny_models_dir):
    # Small prefill steps, so a long prompt takes long enough to cancel half-way.
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir), "EXO_PREFILL_STEP": "16"}
    with loopback_cluster(2, tmp_path, env) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        yield nodes


def test_pipeline_and_tensor_instances_answer_like_a_single_node(two_nodes):
    answers = {}
    for sharding, min_nodes in (("Pipeline", 1), ("Pipeline", 2), ("Tensor", 2)):
        instance_id = place_and_wait(two_nodes[0], sharding, min_nodes)
        instance = two_nodes[0].get(f"/instance/{instance_id}").json()
        assert len(instance["shardAssignments"]["nodeToRunner"]) == min_nodes
        # Ask through the node that is not rank 0 too: chunks cross the cluster.
        answers[(sharding, min_nodes)] = (greedy(two_nodes[0]), greedy(two_nodes[1]))
        delete_and_wait(two_nodes[0], instance_id)
    single = answers[("Pipeline", 1)]
    assert single[0] == single[1] and len(single[0]) > 0
    assert answers[("Pipeline", 2)] == single
    assert answers[("Tensor", 2)] == single


def test_concurrent_requests_batched_on_a_split_answer_as_each_alone_on_one_node(two_nodes):
    """The engine batches decoding requests; every rank must keep the same batch (its
    rows joining and leaving at the same steps), else the ring's collectives would hang
    or mix rows. Four greedy requests of different prompt and answer lengths, sent at
    once, answer on a pipeline and a tensor split as each does alone on one node."""
    prompts = [[{"role": "user", "content": "cluster node " * repeat}] for repeat in (1, 7, 3, 12)]
    lengths = [20, 12, 28, 16]

    def ask(node, index: int) -> str:
        sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = sdk.chat.completions.create(
            model=TINY_MODEL_ID, messages=prompts[index], max_tokens=lengths[index], temperature=0
        )
        return completion.choices[0].message.content or ""

    instance_id = place_and_wait(two_nodes[0], "Pipeline", 1)
    alone = [ask(two_nodes[0], index) for index in range(len(prompts))]
    delete_and_wait(two_nodes[0], instance_id)
    for sharding in ("Pipeline", "Tensor"):
        instance_id = place_and_wait(two_nodes[0], sharding, 2)
        with ThreadPoolExecutor(len(prompts)) as pool:
            # Through both nodes: half the chunks cross the cluster.
            answers = list(pool.map(lambda index: ask(two_nodes[index % 2], index), range(len(prompts))))
        assert answers == alone, sharding
        delete_and_wait(two_nodes[0], instance_id)


def test_cancelling_a_split_instance_request_frees_both_ranks(two_nodes):
    place_and_wait(two_nodes[0], "Pipeline", 2)
    # Abort a long stream mid-decode by closing the connection.
    with httpx.stream(
        "POST",
        f"{two_nodes[1].url}/v1/chat/completions",
        json={"model": TINY_MODEL_ID, "messages": PROMPT, "max_tokens": 5000, "temperature": 0, "stream": True},
        timeout=60,
    ) as response:
        for number, _ in enumerate(response.iter_lines()):
            if number > 20:
                break
    two_nodes[0].wait_for_state(lambda s: s["tasks"] == {}, timeout=10, what="task dropped")
    # Both ranks are free again: the next request completes.
    done = threading.Event()
    result = {}

    def ask():
        result["text"] = greedy(two_nodes[0], max_tokens=8)
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    assert done.wait(60), "the next request hung after a cancellation"
    assert result["text"]


def test_cancelling_during_prefill_frees_both_ranks(two_nodes):
    place_and_wait(two_nodes[0], "Pipeline", 2)
    long_prompt = [{"role": "user", "content": "cluster node model token " * 600}]
    progress = []
    with httpx.stream(
        "POST",
        f"{two_nodes[1].url}/v1/chat/completions",
        json={"model": TINY_MODEL_ID, "messages": long_prompt, "max_tokens": 2000, "temperature": 0, "stream": True},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            assert not line.startswith("data:"), f"the answer started before the cancel: {line}"
            if line.startswith(": prefill"):
                progress.append(line)
                if len(progress) == 3:
                    break
    done, total = map(int, progress[-1].split()[-1].split("/"))
    assert 0 < done < total, progress
    # Left alone, the request would prefill on and then decode up to 2000 tokens.
    two_nodes[0].wait_for_state(lambda s: s["tasks"] == {}, timeout=10, what="task dropped")
    # Both ranks are free again: the next request completes.
    assert greedy(two_nodes[0], max_tokens=8)


def test_killing_one_rank_fails_the_request_and_the_model_moves_to_the_survivor(two_nodes):
    instance_id = place_and_wait(two_nodes[0], "Pipeline", 2)
    state = two_nodes[0].state()
    master = state["masterNodeId"]
    victim = next(n for n in two_nodes if n.node_id() != master)
    survivor = next(n for n in two_nodes if n.node_id() == master)
    sdk = openai.OpenAI(base_url=f"{survivor.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = sdk.chat.completions.create(
        model=TINY_MODEL_ID, messages=PROMPT, max_tokens=5000, temperature=0, stream=True
    )
    started = None
    with pytest.raises(openai.APIError):
        for number, _ in enumerate(stream):
            if number == 10:
                os.killpg(victim.process.pid, signal.SIGKILL)
                started = time.monotonic()
    told = time.monotonic() - started if started is not None else None
    assert told is not None and told < 5, f"the client waited {told} s for the error"
    state = survivor.wait_for_state(lambda s: instance_id not in s["instances"], timeout=30, what="instance torn down")
    assert instance_id in state["instanceDeletions"]
    # The model fits on the survivor alone, so it is placed there again and serves.
    state = survivor.wait_for_state(
        lambda s: [r["kind"] for r in s["runners"].values()] == ["RunnerReady"], timeout=60, what="re-placed"
    )
    (replacement,) = state["instances"].values()
    assert list(replacement["shardAssignments"]["nodeToRunner"]) == [survivor.node_id()]
    assert greedy(survivor, max_tokens=4)
    serving_again = time.monotonic() - started
    # The survivor's rank was freed: only the replacement's runner is left on it.
    assert len(survivor.runner_pids()) == 1
    print(f"rank's node killed: client told in {told:.1f} s, serving again {serving_again:.1f} s after the kill")


def test_killing_one_ranks_runner_fails_the_request_and_the_instance_comes_back(two_nodes):
    """kill -9 of the runner process of rank 1 alone (its node lives on): rank 0, blocked
    in the ring, loses its peer; the client is told at once and both ranks restart."""
    instance_id = place_and_wait(two_nodes[0], "Pipeline", 2)
    instance = two_nodes[0].state()["instances"][instance_id]
    by_rank = {shard["deviceRank"]: runner for runner, shard in instance["shardAssignments"]["runnerToShard"].items()}
    rank1_node_id = next(n for n, r in instance["shardAssignments"]["nodeToRunner"].items() if r == by_rank[1])
    rank1_node = next(n for n in two_nodes if n.node_id() == rank1_node_id)
    sdk = openai.OpenAI(base_url=f"{two_nodes[0].url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = sdk.chat.completions.create(
        model=TINY_MODEL_ID, messages=PROMPT, max_tokens=5000, temperature=0, stream=True
    )
    started = None
    with pytest.raises(openai.APIError):
        for number, _ in enumerate(stream):
            if number == 10:
                (runner_pid,) = rank1_node.runner_pids()
                os.kill(runner_pid, signal.SIGKILL)
                started = time.monotonic()
    told = time.monotonic() - started if started is not None else None
    assert told is not None and told < 5, f"the client waited {told} s for the error"
    rank0_node = next(n for n in two_nodes if n is not rank1_node)
    how = "rank 0 abandoned" if "stopping it so the instance can restart" in rank0_node.logs() else "rank 0 saw it"
    two_nodes[0].wait_for_state(
        lambda s: (
            instance_id in s["instances"]
            and [r["kind"] for r in s["runners"].values()] == ["RunnerReady", "RunnerReady"]
        ),
        timeout=90,
        what="both ranks serving again",
    )
    assert greedy(two_nodes[1], max_tokens=4)
    print(
        f"rank 1's runner killed: client told in {told:.1f} s ({how}), "
        f"serving again {time.monotonic() - started:.1f} s after"
    )


def test_a_ring_port_taken_on_the_host_is_moved_and_the_instance_serves(two_nodes):
    """Rank 0's ring port is held by another program's listener, rank 1's by a connection
    left in TIME_WAIT. The ring would fail with `Couldn't bind socket (error: 98)` on the
    first; the worker finds it taken before its runner binds and the master moves that
    rank to another port. TIME_WAIT does not block a bind with SO_REUSEADDR (as MLX binds),
    so rank 1 keeps its port."""
    planned = (
        two_nodes[0]
        .get("/instance/placement", params={"model_id": TINY_MODEL_ID, "sharding": "Pipeline", "min_nodes": 2})
        .json()
    )
    listener_host, lingering_host = planned["hosts"]
    assert all(host.startswith("127.0.0.1:") for host in planned["hosts"]), planned["hosts"]
    listener = socket.create_server(("127.0.0.1", int(listener_host.rsplit(":", 1)[1])))
    _leave_in_time_wait(int(lingering_host.rsplit(":", 1)[1]))
    try:
        response = two_nodes[0].post("/instance", json={"instance": planned})
        assert response.status_code == 200, response.text
        instance_id = planned["instanceId"]
        state = two_nodes[1].wait_for_state(
            lambda s: (
                instance_id in s["instances"]
                and [r["kind"] for r in s["runners"].values()] == ["RunnerReady", "RunnerReady"]
            ),
            timeout=120,
            what="both ranks ready",
        )
        hosts = state["instances"][instance_id]["hosts"]
        assert hosts[0] != listener_host and hosts[1] == lingering_host, hosts
        assert greedy(two_nodes[1], max_tokens=8)
        events = [e["event"] for e in two_nodes[0].get("/events").json()]
        assert [e["kind"] for e in events].count("InstanceRingMoved") == 1
        statuses = [e["status"]["kind"] for e in events if e["kind"] == "RunnerStatusUpdated"]
        assert "RunnerReady" in statuses and "RunnerFailed" not in statuses
    finally:
        listener.close()


def _leave_in_time_wait(port: int) -> None:
    """A connection accepted on `port` and closed from that side first: its local end
    stays in TIME_WAIT on the port for a minute."""
    with socket.create_server(("127.0.0.1", port)) as server:
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()
        time.sleep(0.1)
        client.close()


THREE_WAY_MODEL_ID = "acme/tiny3"


@pytest.fixture(scope="module")
def three_way_models_dir(tmp_path_factory):
    """3 layers, and widths divisible by 3, so pipeline and tensor both split 3 ways."""
    from exo.devtools.tiny_models import make_tiny_llama

    models_dir = tmp_path_factory.mktemp("models3")
    make_tiny_llama(
        models_dir / "acme--tiny3",
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=192,
    )
    return models_dir


@pytest.mark.parametrize(("network", "count"), [("loopback", 3), ("netns", 2), ("netns", 3)])
def test_split_instances_answer_like_one_node(network, count, tmp_path, three_way_models_dir):
    """The tiny3 model splits 2 ways (layers 2+1, tensor over 6 heads / 3 KV heads does
    not divide by 2, so only pipeline) and 3 ways (both)."""
    make_cluster = loopback_cluster if network == "loopback" else netns_cluster
    with make_cluster(count, tmp_path, {"EXO_MODELS_DIRS": str(three_way_models_dir)}) as nodes:
        wait_converged(nodes, timeout=60)
        links = count * (count - 1)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == links, timeout=60, what=f"{links} links")
        sdk = openai.OpenAI(base_url=f"{nodes[-1].url}/v1", api_key="unused", max_retries=0, timeout=120)
        answers = {}
        shardings = [("Pipeline", 1), ("Pipeline", count)] + ([("Tensor", 3)] if count == 3 else [])
        for sharding, min_nodes in shardings:
            response = nodes[0].post(
                "/place_instance", json={"model_id": THREE_WAY_MODEL_ID, "sharding": sharding, "min_nodes": min_nodes}
            )
            assert response.status_code == 200, response.text
            instance_id = response.json()["instance_id"]
            nodes[-1].wait_for_state(  # the node we ask sees it ready
                lambda s, i=instance_id: (
                    s["instances"].get(i)
                    and all(
                        s["runners"].get(r, {}).get("kind") == "RunnerReady"
                        for r in s["instances"][i]["shardAssignments"]["runnerToShard"]
                    )
                ),
                timeout=180,
                what=f"{sharding} x{min_nodes} ready",
            )
            answers[(sharding, min_nodes)] = (
                sdk.chat.completions.create(model=THREE_WAY_MODEL_ID, messages=PROMPT, max_tokens=16, temperature=0)
                .choices[0]
                .message.content
            )
            delete_and_wait(nodes[0], instance_id)
        assert answers[("Pipeline", count)] == answers[("Pipeline", 1)]
        if count == 3:
            assert answers[("Tensor", 3)] == answers[("Pipeline", 1)]


def test_a_split_across_an_mlx_node_and_a_llamacpp_node_runs_mlx_and_answers_like_one_node(tmp_path, tiny_models_dir):
    """A mixed cluster (as a CUDA node running MLX beside a CPU node running llama.cpp):
    the split runs MLX on both ranks, the llama.cpp node's included, and the preview says
    why. The reference is the MLX node alone, asked before the other node joins."""
    env = {"EXO_MODELS_DIRS": str(tiny_models_dir)}
    with loopback_cluster(1, tmp_path, env, args=("--engine", "mlx")) as nodes:
        wait_converged(nodes)
        instance_id = place_and_wait(nodes[0], "Pipeline", 1)
        alone = greedy(nodes[0])
        delete_and_wait(nodes[0], instance_id)

        nodes.add_node(args=("--engine", "llamacpp"))
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        engines = {info["engine"] for info in nodes[0].state()["nodes"].values()}
        assert engines == {"mlx", "llamacpp"}, engines
        params = {"model_id": TINY_MODEL_ID, "sharding": "Pipeline", "min_nodes": 2}
        [preview, *_] = nodes[0].get("/instance/previews", params=params).json()
        assert preview["error"] is None and "the nodes run different engines" in preview["engineReason"], preview

        instance_id = place_and_wait(nodes[0], "Pipeline", 2)
        instance = nodes[0].get(f"/instance/{instance_id}").json()
        assert instance["engine"] == "mlx" and len(instance["shardAssignments"]["nodeToRunner"]) == 2
        assert greedy(nodes[0]) == alone and greedy(nodes[1]) == alone and len(alone) > 0


@pytest.mark.parametrize("engine", ["mlx", "llamacpp"])
def test_prompt_lookup_on_a_two_node_pipeline_gives_the_plain_text(engine, tmp_path, tiny_models_dir):
    """Every rank runs the same scheduler over the same tokens, so every rank proposes the
    same drafts and keeps the same ones: the split's verify steps agree."""
    with loopback_cluster(2, tmp_path, {"EXO_MODELS_DIRS": str(tiny_models_dir)}, args=("--engine", engine)) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        place_and_wait(nodes[0], "Pipeline", 2)
        sdk = openai.OpenAI(base_url=f"{nodes[1].url}/v1", api_key="unused", max_retries=0, timeout=120)
        asked = {
            "model": TINY_MODEL_ID,
            "messages": [{"role": "user", "content": "cluster node model token the cat runs over the moon " * 6}],
            "max_tokens": 64,
            "temperature": 0,
        }
        plain = sdk.chat.completions.create(**asked)
        fast = sdk.chat.completions.create(**asked, extra_body={"speculative": {"num_draft": 6}})
        assert fast.choices[0].message.content == plain.choices[0].message.content
        assert fast.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_a_draft_model_on_a_two_node_pipeline_gives_the_plain_text(tmp_path):
    """The draft runs on rank 0 alone and rank 0 sends each proposal to rank 1, which
    verifies it in lockstep. A draft of other random weights (same tokenizer) has most
    proposals refused, so both ranks cut their caches back at every verify."""
    models = tmp_path / "models"
    make_tiny_llama(models / TINY_MODEL_ID.replace("/", "--"), num_hidden_layers=4)
    make_tiny_llama(models / "acme--draft", num_hidden_layers=1, seed=5)
    with loopback_cluster(2, tmp_path, {"EXO_MODELS_DIRS": str(models)}, args=("--engine", "mlx")) as nodes:
        wait_converged(nodes)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 2, timeout=30, what="links measured")
        place_and_wait(nodes[0], "Pipeline", 2, draft_model="acme/draft")
        sdk = openai.OpenAI(base_url=f"{nodes[1].url}/v1", api_key="unused", max_retries=0, timeout=120)
        asked = {"model": TINY_MODEL_ID, "messages": PROMPT, "max_tokens": 48, "temperature": 0}
        plain = sdk.chat.completions.create(**asked)
        drafted = sdk.chat.completions.create(**asked, extra_body={"speculative": {"method": "draft", "num_draft": 4}})
        assert drafted.choices[0].message.content == plain.choices[0].message.content
        details = drafted.usage.completion_tokens_details
        print(f"kept {details.accepted_prediction_tokens}, not kept {details.rejected_prediction_tokens}")
        assert details.rejected_prediction_tokens > 0
