"""The real MLX engine in this process, for tests of the engine itself, without a node."""

from dataclasses import replace
from pathlib import Path

from exo.catalog.cards import card_from_model_dir
from exo.engine.mlx.engine import MlxEngine
from exo.shared.types.shards import PipelineShardMetadata


def load_engine(model_dir: Path):
    """One rank holding the whole model, warmed up as a runner does (which also sets its
    memory budget)."""
    card = card_from_model_dir(model_dir, "test/model")
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )
    engine = MlxEngine()
    engine.load(model_dir, shard, lambda done, total: None)
    engine.warm_up()
    return engine


def set_step_tokens(monkeypatch, engine, tokens: int) -> None:
    """The engine's scheduler feeds at most `tokens` tokens a step (for this test)."""
    monkeypatch.setattr(engine.scheduler, "budget", replace(engine.scheduler.budget, step_tokens=tokens))
