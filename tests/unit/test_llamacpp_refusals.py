"""A node's record of the models llama.cpp refused (engine/llamacpp/support.py), and
placement reading it from NodeInfo: the record stands while the model dir's files are
unchanged and replaces the GGUF llama.cpp would not load; an instance of a model one of
its nodes refused is placed on MLX, and the preview says why."""

import os
import shutil
from pathlib import Path

import pytest

from exo.devtools.tiny_models import make_tiny_llama
from exo.engine.llamacpp.gguf_convert import cache_prefix, cache_stem, gguf_for
from exo.engine.llamacpp.support import record_refusal, recorded_refusal, recorded_refusals
from exo.master.placement import instance_previews, place_instance
from exo.shared.models.model_cards import ModelCard, ModelTask, StorageSize
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.instances import EngineKind, Sharding
from exo.shared.types.nodes import MemoryInfo, NodeInfo
from exo.shared.types.state import State

GiB = 1 << 30
WHY = "llama.cpp could not load the GGUF: cannot find tokenizer merges in model file"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("refusals") / "llama")


def test_a_refusal_is_kept_while_the_dir_is_unchanged_and_replaces_its_gguf(tiny_llama: Path, tmp_path: Path):
    model_dir = tmp_path / "acme--llama"
    shutil.copytree(tiny_llama, model_dir)
    cache = tmp_path / "gguf"
    assert recorded_refusal(cache, model_dir) is None and recorded_refusals(cache) == {}
    cache.mkdir()
    (cache / "acme--llama-00000000-old.gguf").write_bytes(b"GGUF")  # another dir's: kept
    (cache / f"{cache_stem(model_dir)}.gguf").write_bytes(b"GGUF")
    record_refusal(cache, model_dir, "acme/llama", WHY)
    assert recorded_refusal(cache, model_dir) == WHY
    assert recorded_refusals(cache) == {"acme/llama": WHY}
    assert [p.name for p in cache.glob("*.gguf")] == ["acme--llama-00000000-old.gguf"]
    # New weights: llama.cpp may take them, so the record no longer holds.
    weights = model_dir / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert recorded_refusal(cache, model_dir) is None and recorded_refusals(cache) == {}
    # Converting the new files drops the stale record with the stale GGUFs.
    gguf_for(model_dir, cache)
    assert sorted(p.suffix for p in cache.iterdir() if p.name.startswith(cache_prefix(model_dir))) == ["", ".gguf"]


def llamacpp_node(name: str, refusals: dict[str, str]) -> NodeInfo:
    return NodeInfo(
        node_id=NodeId(name),
        friendly_name=name,
        os="Linux x86_64",
        backend="cpu",
        engine=EngineKind.LlamaCpp,
        llamacpp_refusals={ModelId(m): why for m, why in refusals.items()},
        cpu_count=8,
        memory=MemoryInfo(total_bytes=64 * GiB, available_bytes=30 * GiB),
        disk_available_bytes=500 * GiB,
        api_port=52415,
    )


def llama_card(model_id: str) -> ModelCard:
    return ModelCard(
        model_id=model_id,
        family="llama",
        n_layers=24,
        hidden_size=4096,
        num_key_value_heads=8,
        tasks=[ModelTask.TextGeneration],
        context_length=4096,
        storage_size=StorageSize(in_bytes=GiB),
    )


def test_a_model_its_node_refused_is_placed_on_mlx_and_the_preview_says_why():
    state = State(nodes={NodeId("a"): llamacpp_node("a", {"acme/nomerges": WHY})})
    assert place_instance(state, llama_card("acme/tiny")).engine == EngineKind.LlamaCpp
    assert place_instance(state, llama_card("acme/nomerges")).engine == EngineKind.Mlx
    (preview, *_) = [p for p in instance_previews(state, llama_card("acme/nomerges"), Sharding.Pipeline) if p.instance]
    assert preview.engine_reason == f"runs on MLX: {WHY}"
