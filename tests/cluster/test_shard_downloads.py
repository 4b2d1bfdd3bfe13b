"""Per-shard downloads: three real nodes place a 3-way pipeline of a model the fake hub
(tests/support/fake_hub.py) holds split into layer-range safetensors files; each node
fetches only the files its layers need and the instance serves."""

import json
from pathlib import Path

import mlx.core as mx
import openai

from exo.devtools.tiny_models import make_tiny_llama
from exo.shared.models.weight_files import INDEX_FILE, files_for_layers
from tests.support.cluster import loopback_cluster, wait_converged
from tests.support.fake_hub import FakeHub
from tests.support.fake_hub import fake_hub as fake_hub  # noqa: F401  (a fixture)

MODEL_ID = "acme/layered"
N_LAYERS = 6


def make_layered_model(path: Path) -> dict[str, str]:
    """The tiny Llama re-saved as one safetensors file per layer plus one for the tensors
    of no layer (embeddings, norm, head), with an index; returns its weight map. Wide MLPs,
    so the layers, not the embeddings, hold most of the bytes, as in a real model."""
    make_tiny_llama(
        path,
        hidden_size=96,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=6,
        num_key_value_heads=3,
        intermediate_size=1536,
    )
    weights = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    groups: dict[str, dict[str, mx.array]] = {}
    count = N_LAYERS + 1
    for name, array in weights.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        file = f"model-{0 if layer is None else int(layer) + 1:05d}-of-{count:05d}.safetensors"
        groups.setdefault(file, {})[name] = array
    weight_map = {}
    for file, tensors in groups.items():
        mx.save_safetensors(str(path / file), tensors, metadata={"format": "mlx"})
        weight_map |= {name: file for name in tensors}
    total = sum((path / file).stat().st_size for file in groups)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


def test_a_three_way_pipeline_downloads_each_node_only_its_layers(fake_hub: FakeHub, tmp_path: Path) -> None:
    endpoint, root = fake_hub
    weight_map = make_layered_model(root / "acme--layered")
    model_bytes = sum(f.stat().st_size for f in (root / "acme--layered").iterdir())
    env = {"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
    with loopback_cluster(3, tmp_path, env, offline=False) as nodes:
        wait_converged(nodes, timeout=60)
        nodes[0].wait_for_state(lambda s: len(s["topology"]["connections"]) == 6, timeout=60, what="6 links")
        assert nodes[0].post("/models/add", json={"model_id": MODEL_ID}).status_code == 200
        response = nodes[0].post("/place_instance", json={"model_id": MODEL_ID, "sharding": "Pipeline", "min_nodes": 3})
        assert response.status_code == 200, response.text
        instance_id = response.json()["instance_id"]
        state = nodes[-1].wait_for_state(
            lambda s: (
                s["instances"].get(instance_id)
                and all(
                    s["runners"].get(r, {}).get("kind") == "RunnerReady"
                    for r in s["instances"][instance_id]["shardAssignments"]["runnerToShard"]
                )
            ),
            timeout=180,
            what="3-way pipeline ready",
        )
        sdk = openai.OpenAI(base_url=f"{nodes[-1].url}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = sdk.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert completion.usage.completion_tokens > 0

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
