"""Where an instance can go: a pure function of State and a model card."""

from itertools import combinations

from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import (
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    new_id,
)
from exo.shared.types.instances import (
    Instance,
    InstanceMeta,
    ShardAssignments,
    Sharding,
)
from exo.shared.types.shards import (
    PipelineShardMetadata,
    ShardMetadata,
    TensorShardMetadata,
)
from exo.shared.types.state import State

# Room left for activations, the runtime and the OS beside the weights.
MEMORY_OVERHEAD = 1.1


class PlacementError(ValueError):
    """No node set can hold the instance; the message says why."""


class PlacementPreview(FrozenModel):
    model_id: ModelId
    sharding: Sharding
    node_ids: list[NodeId]
    memory_needed_bytes: dict[NodeId, int]
    instance: Instance | None = None
    error: str | None = None


def place_instance(
    state: State, card: ModelCard, sharding: Sharding = Sharding.Pipeline, min_nodes: int = 1
) -> Instance:
    previews = instance_previews(state, card, sharding, min_nodes)
    placeable = [p for p in previews if p.instance is not None]
    if placeable:
        # Fewest nodes first: fewer hops, less to coordinate.
        return min(placeable, key=lambda p: len(p.node_ids)).instance  # type: ignore[return-value]
    if not previews:
        raise PlacementError(
            f"cannot place {card.model_id}: the cluster has {len(state.nodes)} worker node(s), "
            f"at least {min_nodes} needed"
        )
    raise PlacementError("; ".join(p.error or "" for p in previews))


def instance_previews(state: State, card: ModelCard, sharding: Sharding, min_nodes: int = 1) -> list[PlacementPreview]:
    node_ids = sorted(state.nodes)
    previews = []
    for size in range(max(min_nodes, 1), len(node_ids) + 1):
        for group in combinations(node_ids, size):
            previews.append(_preview(state, card, sharding, list(group)))
    return previews


def _preview(state: State, card: ModelCard, sharding: Sharding, node_ids: list[NodeId]) -> PlacementPreview:
    n = len(node_ids)
    available = {node_id: state.nodes[node_id].memory.available_bytes for node_id in node_ids}
    if sharding == Sharding.Tensor:
        layer_ranges = [(0, card.n_layers)] * n
        needed = {node_id: int(card.storage_size.in_bytes * MEMORY_OVERHEAD / n) for node_id in node_ids}
    else:
        layer_ranges = split_layers(card.n_layers, [available[node_id] for node_id in node_ids])
        needed = {
            node_id: int(card.storage_size.in_bytes * MEMORY_OVERHEAD * (end - start) / card.n_layers)
            for node_id, (start, end) in zip(node_ids, layer_ranges, strict=True)
        }
    preview = PlacementPreview(
        model_id=ModelId(card.model_id), sharding=sharding, node_ids=node_ids, memory_needed_bytes=needed
    )
    error = _rejection_reason(card, sharding, node_ids, needed, available)
    if error is not None:
        return preview.model_copy(update={"error": error})
    return preview.model_copy(update={"instance": _build_instance(card, sharding, node_ids, layer_ranges)})


def _rejection_reason(
    card: ModelCard,
    sharding: Sharding,
    node_ids: list[NodeId],
    needed: dict[NodeId, int],
    available: dict[NodeId, int],
) -> str | None:
    n = len(node_ids)
    if sharding == Sharding.Tensor and n > 1:
        if not card.supports_tensor:
            return f"{card.model_id} does not support tensor parallelism"
        kv_heads = card.num_key_value_heads or 0
        if card.hidden_size % n or kv_heads % n:
            return (
                f"tensor parallel over {n} nodes needs hidden_size ({card.hidden_size}) and "
                f"num_key_value_heads ({kv_heads}) divisible by {n}"
            )
    if sharding == Sharding.Pipeline and n > card.n_layers:
        return f"{card.model_id} has {card.n_layers} layers, fewer than {n} nodes"
    short = [node_id for node_id in node_ids if needed[node_id] > available[node_id]]
    if short:
        return "; ".join(
            f"node {node_id} has {available[node_id] / 2**30:.2f} GiB free, needs {needed[node_id] / 2**30:.2f} GiB"
            for node_id in short
        )
    return None


def split_layers(n_layers: int, weights: list[int]) -> list[tuple[int, int]]:
    """Contiguous layer ranges proportional to weights, every range non-empty."""
    total = sum(weights) or 1
    bounds = [0]
    for i in range(1, len(weights)):
        share = round(n_layers * sum(weights[:i]) / total)
        bounds.append(min(max(share, bounds[-1] + 1), n_layers - (len(weights) - i)))
    bounds.append(n_layers)
    return list(zip(bounds, bounds[1:], strict=False))


def _build_instance(
    card: ModelCard, sharding: Sharding, node_ids: list[NodeId], layer_ranges: list[tuple[int, int]]
) -> Instance:
    shard_type = TensorShardMetadata if sharding == Sharding.Tensor else PipelineShardMetadata
    runner_to_shard: dict[RunnerId, ShardMetadata] = {}
    node_to_runner: dict[NodeId, RunnerId] = {}
    for rank, (node_id, (start, end)) in enumerate(zip(node_ids, layer_ranges, strict=True)):
        runner_id = RunnerId(new_id())
        runner_to_shard[runner_id] = shard_type(
            model_card=card,
            device_rank=rank,
            world_size=len(node_ids),
            start_layer=start,
            end_layer=end,
            n_layers=card.n_layers,
        )
        node_to_runner[node_id] = runner_id
    return Instance(
        instance_id=InstanceId(new_id()),
        sharding=sharding,
        instance_meta=InstanceMeta.MlxRing,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id), runner_to_shard=runner_to_shard, node_to_runner=node_to_runner
        ),
    )
