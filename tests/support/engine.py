"""The real MLX engine in this process, for tests of the engine itself, without a node."""

from dataclasses import replace

from exo.devtools.local_engine import load_engine
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.instances import EngineKind, Instance, ShardAssignments, Sharding
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams, Usage

__all__ = ["answers", "lone_instance", "load_engine", "set_step_tokens", "tokens_of", "usage_of"]


def lone_instance(card: ModelCard, runner: RunnerId, engine: EngineKind) -> Instance:
    """An instance of one runner holding the whole model ("instance-a" on node "n")."""
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers, n_layers=card.n_layers
    )
    return Instance(
        instance_id=InstanceId("instance-a"),
        sharding=Sharding.Pipeline,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id), runner_to_shard={runner: shard}, node_to_runner={NodeId("n"): runner}
        ),
        engine=engine,
    )


def set_step_tokens(monkeypatch, engine, tokens: int) -> None:
    """The engine's scheduler feeds at most `tokens` tokens a step (for this test)."""
    monkeypatch.setattr(engine.scheduler, "budget", replace(engine.scheduler.budget, step_tokens=tokens))


def answers(engine, requests: dict[str, TextGenerationTaskParams]) -> dict[str, list[ChunkGenerated]]:
    """Every request submitted at once and stepped to the end: each one's chunks."""
    chunks: dict[str, list[ChunkGenerated]] = {name: [] for name in requests}
    for name, params in requests.items():
        engine.submit(CommandId(name), params)
    while engine.has_work:
        for chunk in engine.step():
            chunks[chunk.command_id].append(chunk)
    return chunks


def tokens_of(chunks: list[ChunkGenerated]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def usage_of(chunks: list[ChunkGenerated]) -> Usage:
    [usage] = [chunk.usage for chunk in chunks if chunk.usage is not None]
    return usage
