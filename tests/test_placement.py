"""Placement: where an instance can go and, when it cannot, a reason a person can act
on; and which serving instance takes the next request."""

import itertools
import random

import pytest

from exo.master.master import least_loaded_instance
from exo.master.placement import (
    MEMORY_OVERHEAD,
    PlacementError,
    instance_previews,
    place_instance,
    split_layers,
)
from exo.shared.models.model_cards import (
    ModelCard,
    ModelTask,
    StorageSize,
    builtin_cards,
)
from exo.shared.types.common import (
    CommandId,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.instances import Instance, ShardAssignments, Sharding
from exo.shared.types.nodes import MemoryInfo, NodeInfo
from exo.shared.types.runners import (
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
)
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

GiB = 2**30


@pytest.fixture
def small_card() -> ModelCard:
    return builtin_cards()["mlx-community/Qwen3.5-2B-MLX-8bit"]


def node(node_id: str, available_gib: float) -> NodeInfo:
    return NodeInfo(
        node_id=NodeId(node_id),
        friendly_name=node_id,
        os="macOS",
        backend="metal",
        cpu_count=12,
        memory=MemoryInfo(
            total_bytes=int(max(available_gib, 1) * 2 * GiB),
            available_bytes=int(available_gib * GiB),
        ),
        disk_available_bytes=500 * GiB,
        api_port=52415,
    )


def cluster(**available_gib: float) -> State:
    return State(nodes={NodeId(name): node(name, gib) for name, gib in available_gib.items()})


def tensor_card(hidden_size: int, num_key_value_heads: int) -> ModelCard:
    return ModelCard(
        model_id="test/tensor-model",
        n_layers=24,
        hidden_size=hidden_size,
        num_key_value_heads=num_key_value_heads,
        supports_tensor=True,
        tasks=[ModelTask.TextGeneration],
        storage_size=StorageSize(in_bytes=4 * GiB),
    )


# --- place_instance ------------------------------------------------------------------------


def test_single_node_with_enough_memory_gets_a_one_node_pipeline_instance(
    small_card: ModelCard,
):
    instance = place_instance(cluster(studio=64), small_card)

    assert instance.sharding == Sharding.Pipeline
    assert instance.model_id == small_card.model_id
    assert instance.world_size == 1
    [(runner_id, shard)] = instance.shard_assignments.runner_to_shard.items()
    assert instance.shard_assignments.node_to_runner == {NodeId("studio"): runner_id}
    assert isinstance(shard, PipelineShardMetadata)
    assert (shard.device_rank, shard.world_size) == (0, 1)
    assert (shard.start_layer, shard.end_layer) == (0, small_card.n_layers)


def test_not_enough_memory_names_the_node_and_the_gib_figures(small_card: ModelCard):
    needed_gib = small_card.storage_size.in_bytes * MEMORY_OVERHEAD / GiB

    with pytest.raises(PlacementError) as error:
        place_instance(cluster(macbook=1.5), small_card)

    message = str(error.value)
    assert "macbook" in message
    assert "1.50 GiB free" in message
    assert f"needs {needed_gib:.2f} GiB" in message


def test_fewest_nodes_win_when_one_node_suffices(small_card: ModelCard):
    instance = place_instance(cluster(a=64, b=64), small_card)
    assert instance.world_size == 1


def test_pipeline_over_two_nodes_covers_all_layers_in_rank_order():
    card = builtin_cards()["mlx-community/DeepSeek-V4-Flash"]
    instance = place_instance(cluster(a=100, b=100), card, min_nodes=2)

    shards = sorted(instance.shard_assignments.runner_to_shard.values(), key=lambda s: s.device_rank)
    assert [(s.start_layer, s.end_layer) for s in shards] == [(0, 22), (22, 43)]


def test_empty_cluster_says_how_many_nodes_are_needed(small_card: ModelCard):
    with pytest.raises(PlacementError, match="0 worker node"):
        place_instance(State(), small_card)


# --- split_layers --------------------------------------------------------------------------


def assert_valid_split(n_layers: int, ranges: list[tuple[int, int]], parts: int) -> None:
    assert len(ranges) == parts
    assert ranges[0][0] == 0
    assert ranges[-1][1] == n_layers
    for (_, end), (next_start, _) in itertools.pairwise(ranges):
        assert end == next_start
    assert all(start < end for start, end in ranges)


@pytest.mark.parametrize(
    ("n_layers", "weights", "expected"),
    [
        (10, [1, 1], [(0, 5), (5, 10)]),
        (12, [1, 2, 3], [(0, 2), (2, 6), (6, 12)]),
        (43, [3, 1], [(0, 32), (32, 43)]),
        (61, [512, 192, 128], [(0, 38), (38, 52), (52, 61)]),
    ],
)
def test_split_layers_is_proportional_to_the_weights(n_layers, weights, expected):
    assert split_layers(n_layers, weights) == expected


@pytest.mark.parametrize(
    ("n_layers", "weights"),
    [
        (4, [1000, 1, 1, 1]),  # a tiny node still gets a layer
        (3, [1, 1, 1]),  # exactly one layer each
        (5, [0, 0]),  # no memory reported at all
        (8, [1, 1000]),
    ],
)
def test_split_layers_never_leaves_a_rank_empty(n_layers, weights):
    assert_valid_split(n_layers, split_layers(n_layers, weights), len(weights))


def test_split_layers_is_contiguous_covering_and_non_empty_for_many_weight_lists():
    rng = random.Random(20240601)
    for _ in range(2000):
        parts = rng.randint(1, 8)
        n_layers = rng.randint(parts, 128)
        weights = [rng.choice([0, 1, rng.randint(1, 512 * GiB)]) for _ in range(parts)]
        ranges = split_layers(n_layers, weights)
        assert_valid_split(n_layers, ranges, parts)


# --- tensor --------------------------------------------------------------------------------


def test_tensor_is_rejected_when_hidden_size_is_not_divisible():
    with pytest.raises(PlacementError, match=r"hidden_size \(4096\).*divisible by 3"):
        place_instance(
            cluster(a=64, b=64, c=64),
            tensor_card(4096, 12),
            Sharding.Tensor,
            min_nodes=3,
        )


def test_tensor_is_rejected_when_kv_heads_are_not_divisible():
    # DeepSeek V4 Flash has a single KV head.
    card = builtin_cards()["mlx-community/DeepSeek-V4-Flash"]
    with pytest.raises(PlacementError, match=r"num_key_value_heads \(1\).*divisible by 2"):
        place_instance(cluster(a=200, b=200), card, Sharding.Tensor, min_nodes=2)


def test_tensor_over_two_nodes_gives_every_rank_every_layer():
    instance = place_instance(cluster(a=64, b=64), tensor_card(4096, 8), Sharding.Tensor, min_nodes=2)
    shards = instance.shard_assignments.runner_to_shard.values()
    assert {(s.kind, s.start_layer, s.end_layer) for s in shards} == {("tensor", 0, 24)}
    assert sorted(s.device_rank for s in shards) == [0, 1]


# --- previews ------------------------------------------------------------------------------


def test_instance_previews_list_rejected_options_with_an_error_reason(
    small_card: ModelCard,
):
    previews = instance_previews(cluster(big=64, tiny=0.5), small_card, Sharding.Pipeline)

    by_nodes = {tuple(p.node_ids): p for p in previews}
    assert set(by_nodes) == {("big",), ("tiny",), ("big", "tiny")}
    assert by_nodes[("big",)].instance is not None
    assert by_nodes[("big",)].error is None
    rejected = by_nodes[("tiny",)]
    assert rejected.instance is None
    assert "node tiny has 0.50 GiB free" in rejected.error


# --- least_loaded_instance -------------------------------------------------------------------


def serving_instance(card: ModelCard, instance_id: str) -> Instance:
    runner_id = RunnerId(f"runner-of-{instance_id}")
    return Instance(
        instance_id=InstanceId(instance_id),
        sharding=Sharding.Pipeline,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id),
            runner_to_shard={
                runner_id: PipelineShardMetadata(
                    model_card=card,
                    device_rank=0,
                    world_size=1,
                    start_layer=0,
                    end_layer=card.n_layers,
                    n_layers=card.n_layers,
                )
            },
            node_to_runner={NodeId(f"node-of-{instance_id}"): runner_id},
        ),
    )


def task_on(instance_id: str, number: int, status: TaskStatus = TaskStatus.Running) -> TextGenerationTask:
    return TextGenerationTask(
        task_id=TaskId(f"{instance_id}-task-{number}"),
        command_id=CommandId(f"{instance_id}-command-{number}"),
        instance_id=InstanceId(instance_id),
        params=TextGenerationTaskParams(model=ModelId("m"), messages=[ChatMessage(role="user", content="hi")]),
        status=status,
    )


def load_state(
    card: ModelCard,
    runner_status: dict[str, RunnerStatus],
    tasks: list[TextGenerationTask],
) -> State:
    return State(
        instances={InstanceId(i): serving_instance(card, i) for i in runner_status},
        runners={RunnerId(f"runner-of-{i}"): status for i, status in runner_status.items()},
        tasks={t.task_id: t for t in tasks},
    )


def test_least_loaded_instance_picks_the_one_with_fewer_unfinished_tasks(
    small_card: ModelCard,
):
    state = load_state(
        small_card,
        {"busy": RunnerRunning(active_tasks=2), "quiet": RunnerRunning()},
        [
            task_on("busy", 1),
            task_on("busy", 2, TaskStatus.Pending),
            task_on("quiet", 1),
        ],
    )
    assert least_loaded_instance(state, ModelId(small_card.model_id)) == "quiet"


def test_finished_tasks_do_not_count_as_load(small_card: ModelCard):
    state = load_state(
        small_card,
        {"a": RunnerReady(), "b": RunnerRunning()},
        [
            task_on("a", 1, TaskStatus.Complete),
            task_on("a", 2, TaskStatus.Failed),
            task_on("a", 3, TaskStatus.Cancelled),
            task_on("b", 1),
        ],
    )
    assert least_loaded_instance(state, ModelId(small_card.model_id)) == "a"


def test_instances_whose_runners_are_not_serving_are_ignored(small_card: ModelCard):
    state = load_state(
        small_card,
        {
            "loading": RunnerLoading(layers_loaded=3, total_layers=24),
            "serving": RunnerRunning(),
        },
        [task_on("serving", 1), task_on("serving", 2)],
    )
    assert least_loaded_instance(state, ModelId(small_card.model_id)) == "serving"


def test_no_instance_when_none_serves_the_model(small_card: ModelCard):
    state = load_state(small_card, {"loading": RunnerLoading()}, [])
    assert least_loaded_instance(state, ModelId(small_card.model_id)) is None
    assert least_loaded_instance(state, ModelId("other/model")) is None
