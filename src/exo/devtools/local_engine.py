"""exo's MLX engine in this process, one rank holding the whole model, warmed up as a
runner does (which also sets its memory budget): for benches and tests of the engine
itself, without a node."""

from pathlib import Path
from typing import TYPE_CHECKING

from exo.catalog.cards import card_from_model_dir
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.shards import PipelineShardMetadata

if TYPE_CHECKING:
    from exo.engine.llamacpp.engine import LlamaCppEngine


def _whole_model(model_dir: Path, model_id: str) -> PipelineShardMetadata:
    card = card_from_model_dir(model_dir, model_id)
    return PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )


def load_engine(model_dir: Path, model_id: str = "test/model") -> MlxEngine:
    shard = _whole_model(model_dir, model_id)
    engine = MlxEngine()
    engine.load(model_dir, shard, lambda done, total: None)
    engine.warm_up()
    return engine


def load_llamacpp_engine(model_dir: Path, model_id: str = "test/model") -> "LlamaCppEngine":
    """exo's llama.cpp engine in this process (converting the model to a GGUF in
    EXO_HOME's cache on first use), one rank, warmed up."""
    from exo.engine.llamacpp.engine import LlamaCppEngine

    shard = _whole_model(model_dir, model_id)
    engine = LlamaCppEngine()
    engine.load(model_dir, shard, lambda done, total: None)
    engine.warm_up()
    return engine
