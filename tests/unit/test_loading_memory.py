"""Loading gives back each layer's temporaries as it goes, and says what it did about the
wired-memory limit.

A Qwen3 MoE in Hugging Face layout (8 layers, 16 experts, ~100 MiB in float32) is loaded
by the engine's loader in this process. mlx-lm stacks each layer's experts as it reads
them, so every layer leaves its unstacked expert weights (~12 MiB) in MLX's buffer cache.
What MLX holds (active plus cached memory) after each layer must be the weights of the
layers read so far and no more, and nothing is left cached after the load. Without
clearing, the cache carries one layer's temporaries through the whole load and after it.

What this Linux CPU box cannot show: the wired-memory limit exists only on Metal; here
the loader only logs that it left it alone."""

import copy
from pathlib import Path

import mlx.core as mx
from loguru import logger
from mlx.utils import tree_flatten

from exo.catalog.cards import card_from_model_dir
from exo.devtools.onboard import write_reference_model
from exo.devtools.tiny_configs import TINY_CONFIGS
from exo.engine.mlx.loading import load_shard, model_layers
from exo.shared.types.shards import PipelineShardMetadata

MIB = 1 << 20


def _nbytes(module) -> int:
    return sum(p.nbytes for _, p in tree_flatten(module.parameters()))


def test_memory_held_while_loading_is_the_weights_read_so_far(tmp_path: Path) -> None:
    config = copy.deepcopy(TINY_CONFIGS["qwen3_moe"])
    config.update(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=16, num_hidden_layers=8
    )
    write_reference_model(tmp_path, config)
    card = card_from_model_dir(tmp_path, "test/model")
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )
    messages: list[str] = []
    sink = logger.add(lambda message: messages.append(str(message)), level="INFO")
    mx.clear_cache()
    before = mx.get_active_memory()
    held: list[int] = []
    try:
        model, _ = load_shard(
            tmp_path, shard, None, lambda done, total: held.append(mx.get_active_memory() + mx.get_cache_memory())
        )
    finally:
        logger.remove(sink)
    layers = model_layers(model)
    read_so_far = [before + sum(_nbytes(layer) for layer in layers[:i]) for i in range(1, len(layers) + 1)]
    excess = [(h - r) / MIB for h, r in zip(held, read_so_far, strict=True)]
    print(f"weights {_nbytes(model) / MIB:.1f} MiB; held beyond the layers read, per layer (MiB): {excess}")
    assert _nbytes(model) > 90 * MIB
    assert max(excess) <= 0.5, excess
    assert mx.get_cache_memory() == 0
    assert any("wired-memory limit" in message for message in messages), messages
