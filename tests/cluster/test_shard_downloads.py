"""Per-shard downloads: three real nodes place a 3-way pipeline of a model the fake hub
(tests/support/fake_hub.py) holds split into layer-range safetensors files; each node
fetches only the files its layers need and the instance serves."""

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest

from exo.devtools.tiny_models import make_tiny_llama
from exo.shared.models.weight_files import INDEX_FILE, files_for_layers
from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)

MODEL_ID = "acme/layered"
N_LAYERS = 6
MB = 1 << 20


def _layer_file(name: str) -> str:
    """One file per layer plus one for the tensors of no layer."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    return f"model-{0 if layer is None else int(layer) + 1:05d}-of-{N_LAYERS + 1:05d}.safetensors"


def hub_file(name: str) -> str:
    """The usual hub layout of three files: the embeddings with the first layers, the
    middle layers, the last layers with the final norm and the head (as save_pretrained
    shards a checkpoint, tensors in module order)."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    if layer is None:
        part = 1 if name.startswith("model.embed_tokens.") else 3
    else:
        part = 1 + layer * 3 // N_LAYERS
    return f"model-{part:05d}-of-00003.safetensors"


def make_layered_model(
    path: Path, num_key_value_heads: int = 3, file_of: Callable[[str], str] = _layer_file, tied: bool = False
) -> dict[str, str]:
    """The tiny Llama re-saved as several safetensors files with an index (by default one
    per layer plus one for the tensors of no layer: embeddings, norm, head; `file_of`
    names each tensor's file); returns its weight map. Wide MLPs, so the layers, not the
    embeddings, hold most of the bytes, as in a real model. `tied`: the head is the
    embeddings (no lm_head)."""
    make_tiny_llama(
        path,
        hidden_size=96,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=6,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=1536,
    )
    weights = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    if tied:
        del weights["lm_head.weight"]
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    groups: dict[str, dict[str, mx.array]] = {}
    for name, array in weights.items():
        groups.setdefault(file_of(name), {})[name] = array
    weight_map = {}
    for file, tensors in groups.items():
        mx.save_safetensors(str(path / file), tensors, metadata={"format": "mlx"})
        weight_map |= {name: file for name in tensors}
    total = sum((path / file).stat().st_size for file in groups)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


@contextlib.contextmanager
def cluster_with_the_model(count: int, endpoint: str, tmp_path: Path, args: tuple[str, ...] = ()) -> Iterator[list]:
    """`count` nodes on loopback that download from the fake hub, linked both ways, with
    MODEL_ID's card added. They run MLX unless `args` say otherwise: per-shard downloads
    are an MLX pipeline's (a llama.cpp split's rank 0 loads every layer and fetches them
    all; its followers fetch none)."""
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    with loopback_cluster(count, tmp_path, env, args=("--engine", "mlx", *args), offline=False) as nodes:
        wait_converged(nodes, timeout=60)
        links = count * (count - 1)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == links, timeout=60, what="links")
        assert nodes[0].post("/models/add", json={"model_id": MODEL_ID}).status_code == 200
        yield nodes


def answers(node) -> bool:
    sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    return (completion.usage.completion_tokens if completion.usage else 0) > 0


def greedy_text(node) -> str:
    sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "Tell me about the layers of a pipeline, each rank in turn, and what each one sends on."
    completion = sdk.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 24
    return completion.choices[0].message.content or ""


def peer_speed(peer) -> float:
    """Bytes per second of a peer's biggest file through its peer hub, fetched 20 times."""
    record = peer.state()["downloads"][peer.node_id()][MODEL_ID]
    biggest = max(record["files"], key=lambda name: (Path(record["path"]) / name).stat().st_size)
    url = f"{peer.url}/peer-hub/{MODEL_ID}/resolve/main/{biggest}"
    started, received = time.monotonic(), 0
    with httpx.Client() as client:
        for _ in range(20):
            received += len(client.get(url).raise_for_status().content)
    return received / (time.monotonic() - started)


def place_ready(nodes, min_nodes: int, sharding: str = "Pipeline") -> str:
    """Places an instance of MODEL_ID over min_nodes nodes; once every runner is ready and
    every download record of it is complete, returns its id."""
    response = nodes[0].post(
        "/place_instance", json={"model_id": MODEL_ID, "sharding": sharding, "min_nodes": min_nodes}
    )
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]

    def ready(s: dict) -> bool:
        instance = s["instances"].get(instance_id)
        if not instance:
            return False
        assignments = instance["shardAssignments"]
        return all(s["runners"].get(r, {}).get("kind") == "RunnerReady" for r in assignments["runnerToShard"]) and all(
            s["downloads"].get(n, {}).get(MODEL_ID, {}).get("kind") == "DownloadCompleted"
            for n in assignments["nodeToRunner"]
        )

    for node in nodes:
        node.wait_for_state(ready, timeout=180, what=f"{sharding} x{min_nodes} ready")
    return instance_id


def test_a_three_way_pipeline_downloads_each_node_only_its_layers(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered")
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    with cluster_with_the_model(3, endpoint, tmp_path) as nodes:
        instance_id = place_ready(nodes, min_nodes=3)
        state = nodes[-1].state()
        assert answers(nodes[-1])

        assignments = state["instances"][instance_id]["shardAssignments"]
        for node in nodes:
            node_id = node.node_id()
            shard = assignments["runnerToShard"][assignments["nodeToRunner"][node_id]]
            layers = (shard["startLayer"], shard["endLayer"])
            assert layers != (0, N_LAYERS)
            record = state["downloads"][node_id][MODEL_ID]
            assert record["kind"] == "DownloadCompleted" and tuple(record["layers"]) == layers, record
            held = {name for name in record["files"] if name.endswith(".safetensors")}
            assert held == files_for_layers(weight_map, layers), (layers, record["files"])
            on_disk = {f.name for f in (node.home / "models").rglob("*.safetensors")}
            assert on_disk == held
        ratio = fake_hub.body_bytes_sent / model_bytes
        print(f"3-way pipeline, per-shard downloads: hub bytes / model size = {ratio:.3f}")
        assert ratio < 1.3, ratio


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_three_fresh_nodes_fetch_only_their_ranks_files_of_a_three_file_checkpoint(
    fake_hub: FakeHub, tmp_path: Path, tied: bool
) -> None:
    """The usual hub layout (embeddings with the first layers, final norm and head with the
    last) placed as a 3-way pipeline on 3 nodes holding nothing (issue 33 point 3): rank 0
    fetches the first file, rank 1 the middle one, rank 2 the last one (and the first too
    where the head is the tied embeddings: rank 0's node takes it from the hub, rank 2's
    from rank 0's), so the hub sends the model once; the split's greedy text is one
    node's. Before, every MLX rank computed the logits, so each fetched the embeddings'
    and the head's files: 5 files of 3 for the untied model."""
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered", file_of=hub_file, tied=tied)
    files = sorted(set(weight_map.values()))
    assert len(files) == 3
    expected = {0: {files[0]}, 1: {files[1]}, 2: {files[2], *([files[0]] if tied else [])}}
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    with cluster_with_the_model(3, endpoint, tmp_path) as nodes:
        instance_id = place_ready(nodes, min_nodes=3)
        ratio = fake_hub.body_bytes_sent / model_bytes
        state = nodes[0].state()
        assignments = state["instances"][instance_id]["shardAssignments"]
        fetched, held_weights = {}, {}
        for node in nodes:
            node_id = node.node_id()
            rank = assignments["runnerToShard"][assignments["nodeToRunner"][node_id]]["deviceRank"]
            on_disk = {f.name: f.stat().st_size for f in (node.home / "models").rglob("*.safetensors")}
            assert set(on_disk) == expected[rank], (rank, on_disk)
            record = state["downloads"][node_id][MODEL_ID]
            assert {name for name in record["files"] if name.endswith(".safetensors")} == expected[rank], record
            fetched[rank] = sum(on_disk.values())
            status = state["runners"][assignments["nodeToRunner"][node_id]]
            held_weights[rank] = (status.get("memory") or {}).get("weightsBytes")
        print(f"weights in memory per rank (MLX active memory after warm-up): {dict(sorted(held_weights.items()))}")
        print(
            f"3-file hub layout ({'tied' if tied else 'untied'}), 3-way pipeline on fresh nodes: "
            f"hub bytes / model size = {ratio:.3f}; weight bytes per rank {dict(sorted(fetched.items()))} "
            f"of {model_bytes}"
        )
        split_text = greedy_text(nodes[0])
        assert ratio <= 1.1, ratio

        assert nodes[0].delete(f"/instance/{instance_id}").status_code == 200
        nodes[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="gone")
        place_ready(nodes, min_nodes=1)
        assert greedy_text(nodes[0]) == split_text


def test_a_llamacpp_split_fetches_every_weight_to_rank_0_and_none_to_its_follower(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    """Rank 0 sends the follower its layers over ggml's RPC: the follower's download is the
    config and tokenizer only, and the split still serves."""
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered")
    with cluster_with_the_model(2, endpoint, tmp_path, args=("--engine", "llamacpp")) as nodes:
        instance_id = place_ready(nodes, min_nodes=2)
        state = nodes[0].state()
        instance = state["instances"][instance_id]
        assert instance["engine"] == "llamacpp"
        assert answers(nodes[0])
        assignments = instance["shardAssignments"]
        for node in nodes:
            node_id = node.node_id()
            rank = assignments["runnerToShard"][assignments["nodeToRunner"][node_id]]["deviceRank"]
            record = state["downloads"][node_id][MODEL_ID]
            held = {name for name in record["files"] if name.endswith(".safetensors")}
            on_disk = {f.name for f in (node.home / "models").rglob("*.safetensors")}
            expected = set(weight_map.values()) if rank == 0 else set()
            assert held == on_disk == expected, (rank, record)
            assert "config.json" in record["files"]


def test_with_the_hub_stopped_a_node_takes_the_files_it_lacks_from_its_peer(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    make_layered_model(root / "acme--layered")
    source = {f.name: f.read_bytes() for f in (root / "acme--layered").iterdir()}
    with cluster_with_the_model(2, endpoint, tmp_path) as nodes:
        instance_id = place_ready(nodes, min_nodes=2)
        assert nodes[0].delete(f"/instance/{instance_id}").status_code == 200
        nodes[0].wait_for_state(lambda s: s["instances"] == {} and s["runners"] == {}, timeout=30, what="gone")
        fake_hub.stop()  # from now on only the peer has the other node's layers

        instance_id = place_ready(nodes, min_nodes=1)
        state = nodes[0].state()
        (node_id,) = state["instances"][instance_id]["shardAssignments"]["nodeToRunner"]
        node = next(n for n in nodes if n.node_id() == node_id)
        model_dir = node.home / "models" / "acme--layered"
        assert {f.name: f.read_bytes() for f in model_dir.iterdir()} == source
        assert f"of {MODEL_ID} from peer http://127.0.0.1:" in node.logs()
        peer = next(n for n in nodes if n is not node)
        print(f"peer transfer on loopback: {peer_speed(peer) / 1e6:.0f} MB/s")
        assert answers(node)


def test_three_nodes_with_the_hub_stopped_after_one_has_the_model(fake_hub: FakeHub, tmp_path: Path) -> None:
    """One node downloads the whole model (POST /download/start through another node's
    API, no instance); the hub stops; a 3-way pipeline places, and the other two take
    their layers from that node. Then a third node's API deletes the holder's files."""
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered")
    source = {f.name: f.read_bytes() for f in (root / "acme--layered").iterdir()}
    model_bytes = sum(len(b) for b in source.values())
    with cluster_with_the_model(3, endpoint, tmp_path) as nodes:
        holder = nodes[0]
        holder_id = holder.node_id()
        started = nodes[1].post("/download/start", json={"model_id": MODEL_ID, "node_id": holder_id})
        assert started.status_code == 200, started.text
        holder.wait_for_state(
            lambda s: s["downloads"].get(holder_id, {}).get(MODEL_ID, {}).get("kind") == "DownloadCompleted",
            timeout=60,
            what="the holder's download",
        )
        assert holder.state()["instances"] == {}
        hub_bytes = fake_hub.body_bytes_sent
        fake_hub.stop()

        instance_id = place_ready(nodes, min_nodes=3)
        state = nodes[0].state()
        assignments = state["instances"][instance_id]["shardAssignments"]
        for node in nodes[1:]:
            node_id = node.node_id()
            shard = assignments["runnerToShard"][assignments["nodeToRunner"][node_id]]
            layers = (shard["startLayer"], shard["endLayer"])
            held = {f.name for f in (node.home / "models").rglob("*.safetensors")}
            assert held == files_for_layers(weight_map, layers), (layers, held)
            for path in (node.home / "models").rglob("*.safetensors"):
                assert path.read_bytes() == source[path.name]
            assert f"of {MODEL_ID} from peer http://127.0.0.1:{holder.api_port}" in node.logs()
        assert answers(nodes[1])
        print(f"3 nodes, hub stopped after one: hub bytes / model size = {hub_bytes / model_bytes:.3f}")
        assert hub_bytes / model_bytes < 1.1

        in_use = nodes[2].delete(f"/download/{holder_id}/{MODEL_ID}")
        assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "model_in_use", in_use.text
        assert nodes[2].delete(f"/instance/{instance_id}").status_code == 200
        nodes[2].wait_for_state(lambda s: s["instances"] == {}, timeout=30, what="instance gone")
        assert nodes[2].delete(f"/download/{holder_id}/{MODEL_ID}").status_code == 200
        holder.wait_for_state(lambda s: MODEL_ID not in s["downloads"].get(holder_id, {}), timeout=30, what="deleted")
        assert not list((holder.home / "models").rglob("*.safetensors"))
        assert list((nodes[1].home / "models").rglob("*.safetensors")), "another node's files went too"
