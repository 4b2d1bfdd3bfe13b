"""Placement: where an instance can go and, when it cannot, a reason a person can act
on; and which serving instance takes the next request."""

import itertools
import random

import pytest

from exo.catalog.cards import builtin_cards
from exo.master.placement import (
    RING_BASE_PORT,
    RUNTIME_OVERHEAD_BYTES,
    PlacementError,
    instance_previews,
    instance_problem,
    kv_cache_bytes,
    place_disaggregated,
    place_instance,
    split_layers,
    splits_to_move_to_mlx,
    with_free_ring_ports,
    with_ring_port_moved,
)
from exo.shared.models.model_cards import (
    ModelCard,
    ModelTask,
    StorageSize,
)
from exo.shared.queries import layers_needed, least_loaded_instance
from exo.shared.types.common import (
    CommandId,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.instances import (
    EngineKind,
    Instance,
    PrefillFor,
    PrefillPlacement,
    ShardAssignments,
    Sharding,
)
from exo.shared.types.nodes import MemoryInfo, NodeInfo
from exo.shared.types.runners import (
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
)
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.shared.types.topology import Connection, Topology

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
    """Nodes with this much free memory and no links between them."""
    return State(nodes={NodeId(name): node(name, gib) for name, gib in available_gib.items()})


def ip_of(name: str) -> str:
    return f"10.0.0.{ord(name[0]) - ord('a') + 1}"


def linked(
    state: State,
    *pairs: str,
    bandwidth_mbps: float | None = None,
    latency_ms: float | None = None,
    one_way: bool = False,
) -> State:
    """`state` with links both ways (or only first -> second) for each "a-b" pair; each
    node is reached at its own 10.0.0.x address."""
    topology = state.topology
    for pair in pairs:
        first, second = (NodeId(name) for name in pair.split("-"))
        for source, sink in [(first, second)] if one_way else [(first, second), (second, first)]:
            topology = topology.with_connection(
                Connection(
                    source=source,
                    sink=sink,
                    sink_ip=ip_of(sink),
                    bandwidth_mbps=bandwidth_mbps,
                    latency_ms=latency_ms,
                )
            )
    return state.model_copy(update={"topology": topology})


def fully_linked(**available_gib: float) -> State:
    names = list(available_gib)
    return linked(cluster(**available_gib), *(f"{a}-{b}" for a, b in itertools.combinations(names, 2)))


def make_card(
    *,
    n_layers: int = 24,
    hidden_size: int = 4096,
    num_key_value_heads: int = 8,
    weights_gib: float = 4,
    context_length: int = 4096,
    supports_tensor: bool = True,
    base_model: str = "",
) -> ModelCard:
    return ModelCard(
        model_id="test/model",
        n_layers=n_layers,
        hidden_size=hidden_size,
        num_key_value_heads=num_key_value_heads,
        supports_tensor=supports_tensor,
        tasks=[ModelTask.TextGeneration],
        base_model=base_model,
        context_length=context_length,
        storage_size=StorageSize(in_bytes=int(weights_gib * GiB)),
    )


def tensor_card(hidden_size: int, num_key_value_heads: int) -> ModelCard:
    return make_card(hidden_size=hidden_size, num_key_value_heads=num_key_value_heads)


def shards_by_rank(instance: Instance) -> list[ShardMetadata]:
    return sorted(instance.shard_assignments.runner_to_shard.values(), key=lambda s: s.device_rank)


def nodes_by_rank(instance: Instance) -> list[NodeId]:
    runner_to_node = {runner: node for node, runner in instance.shard_assignments.node_to_runner.items()}
    ranked = sorted(instance.shard_assignments.runner_to_shard.items(), key=lambda item: item[1].device_rank)
    return [runner_to_node[runner] for runner, _ in ranked]


# --- place_instance ------------------------------------------------------------------------


def test_single_node_with_enough_memory_gets_a_one_node_pipeline_instance(
    small_card: ModelCard,
):
    instance = place_instance(cluster(studio=64), small_card)

    assert instance.sharding == Sharding.Pipeline
    assert instance.model_id == small_card.model_id
    assert instance.world_size == 1
    assert instance.hosts == []
    [(runner_id, shard)] = instance.shard_assignments.runner_to_shard.items()
    assert instance.shard_assignments.node_to_runner == {NodeId("studio"): runner_id}
    assert isinstance(shard, PipelineShardMetadata)
    assert (shard.device_rank, shard.world_size) == (0, 1)
    assert (shard.start_layer, shard.end_layer) == (0, small_card.n_layers)


def test_not_enough_memory_names_the_node_and_the_gib_figures(small_card: ModelCard):
    kv_bytes = kv_cache_bytes(small_card, small_card.context_length)
    needed_gib = (small_card.storage_size.in_bytes + kv_bytes + RUNTIME_OVERHEAD_BYTES) / GiB

    with pytest.raises(PlacementError) as error:
        place_instance(cluster(macbook=1.5), small_card)

    message = str(error.value)
    assert "macbook" in message
    assert "1.50 GiB free" in message
    assert f"needs {needed_gib:.2f} GiB" in message
    assert f"{kv_bytes / GiB:.2f} GiB KV cache for {small_card.context_length} tokens" in message


def test_fewest_nodes_win_when_one_node_suffices(small_card: ModelCard):
    instance = place_instance(fully_linked(a=64, b=64), small_card)
    assert instance.world_size == 1


def test_among_single_nodes_the_one_with_most_free_memory_wins(small_card: ModelCard):
    instance = place_instance(cluster(a=30, b=60, c=45), small_card)
    assert list(instance.shard_assignments.node_to_runner) == [NodeId("b")]


def test_pipeline_over_two_nodes_covers_all_layers_in_rank_order():
    card = builtin_cards()["mlx-community/DeepSeek-V4-Flash"]
    instance = place_instance(fully_linked(a=100, b=100), card, min_nodes=2)

    assert [(s.start_layer, s.end_layer) for s in shards_by_rank(instance)] == [(0, 22), (22, 43)]


def test_empty_cluster_says_how_many_nodes_are_needed(small_card: ModelCard):
    with pytest.raises(PlacementError, match="0 worker node"):
        place_instance(State(), small_card)


def test_fewer_worker_nodes_than_min_nodes_says_so(small_card: ModelCard):
    with pytest.raises(PlacementError, match=r"1 worker node\(s\), at least 2 needed"):
        place_instance(cluster(a=64), small_card, min_nodes=2)
    assert instance_previews(cluster(a=64), small_card, Sharding.Pipeline, min_nodes=2) == []


# --- KV cache ------------------------------------------------------------------------------


def test_kv_cache_bytes_counts_keys_and_values_of_every_layer_in_bf16():
    # No attention head count on the card: head_dim is assumed to be 128.
    card = make_card(n_layers=24, num_key_value_heads=8)
    assert kv_cache_bytes(card, 1000) == 2 * 24 * 8 * 128 * 1000 * 2


def test_a_model_that_fits_by_weights_but_not_with_its_kv_cache_is_rejected():
    card = make_card(weights_gib=4, context_length=131072)  # 12 GiB of KV cache at full context
    with pytest.raises(PlacementError, match=r"node a has 8.00 GiB free, needs 17.00 GiB") as error:
        place_instance(cluster(a=8), card)
    assert "12.00 GiB KV cache for 131072 tokens" in str(error.value)


def test_the_same_model_fits_with_a_smaller_requested_context():
    card = make_card(weights_gib=4, context_length=131072)
    instance = place_instance(cluster(a=8), card, context_length=8192)
    assert instance.world_size == 1


def test_a_requested_context_is_capped_by_the_cards():
    card = make_card(context_length=4096)
    [preview] = instance_previews(cluster(a=64), card, Sharding.Pipeline, context_length=1_000_000)
    assert preview.context_length == 4096
    [preview] = instance_previews(cluster(a=64), card, Sharding.Pipeline)
    assert preview.context_length == 4096


def test_kv_cache_makes_a_second_node_necessary():
    # 4 GiB of weights and 12 GiB of cache: no 10 GiB node holds it, two share it.
    card = make_card(weights_gib=4, context_length=131072)
    instance = place_instance(fully_linked(a=10, b=10), card)
    assert instance.world_size == 2


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


def test_pipeline_layers_are_split_in_proportion_to_free_memory_beyond_the_overhead():
    # 60 GiB and 20 GiB left after the 1 GiB runtime overhead: three layers to one.
    card = make_card(n_layers=40, weights_gib=40)
    instance = place_instance(fully_linked(a=61, b=21), card, min_nodes=2)

    assert nodes_by_rank(instance) == ["a", "b"]
    assert [(s.start_layer, s.end_layer) for s in shards_by_rank(instance)] == [(0, 30), (30, 40)]


def test_split_layers_keeps_the_tail_on_the_last_rank_for_many_weight_lists():
    rng = random.Random(20261130)
    for _ in range(2000):
        parts = rng.randint(1, 6)
        n_layers = rng.randint(parts, 64)
        tail_start = rng.randint(parts - 1, n_layers - 1)
        weights = [rng.choice([0, 1, rng.randint(1, 512 * GiB)]) for _ in range(parts)]
        ranges = split_layers(n_layers, weights, tail_start)
        assert_valid_split(n_layers, ranges, parts)
        assert ranges[-1][0] <= tail_start, (n_layers, weights, tail_start, ranges)


def test_gemma4_e2b_pipeline_keeps_the_kv_shared_layers_with_their_sources():
    # Equal memory would cut at layer 17 (not 18: rank 0 also holds the card's vision
    # tower), between the KV-shared layers (15..34) and layers 13 and 14 whose keys and
    # values they read; the cut moves back to 13.
    card = builtin_cards()["mlx-community/gemma-4-e2b-it-4bit"]
    assert card.pipeline_tail_start == 13
    instance = place_instance(fully_linked(a=64, b=64), card, min_nodes=2)
    assert [(s.start_layer, s.end_layer) for s in shards_by_rank(instance)] == [(0, 13), (13, 35)]
    # Without the rule the same nodes split in the middle.
    plain = card.model_copy(update={"pipeline_tail_start": None})
    assert [
        (s.start_layer, s.end_layer)
        for s in shards_by_rank(place_instance(fully_linked(a=64, b=64), plain, min_nodes=2))
    ] == [(0, 17), (17, 35)]


def test_a_pipeline_with_more_ranks_than_layers_before_the_kv_shared_tail_is_rejected():
    card = make_card(n_layers=8).model_copy(update={"pipeline_tail_start": 2})
    three = instance_previews(fully_linked(a=64, b=64, c=64), card, Sharding.Pipeline, 3)
    assert [(s.start_layer, s.end_layer) for s in shards_by_rank(three[0].instance)] == [(0, 1), (1, 2), (2, 8)]
    four = instance_previews(fully_linked(a=64, b=64, c=64, d=64), card, Sharding.Pipeline, 4)
    assert all(p.instance is None for p in four)
    assert "keeps layers 2..7 on one pipeline rank" in four[0].error


def test_pipeline_with_more_nodes_than_layers_is_rejected():
    previews = instance_previews(fully_linked(a=64, b=64, c=64), make_card(n_layers=2), Sharding.Pipeline, 3)
    [preview] = previews
    assert preview.instance is None
    assert "2 layers, too few for 3 pipeline ranks" in preview.error


# --- tensor --------------------------------------------------------------------------------


def test_tensor_is_rejected_when_hidden_size_is_not_divisible():
    with pytest.raises(PlacementError, match=r"hidden_size \(4096\).*divisible by 3"):
        place_instance(
            fully_linked(a=64, b=64, c=64),
            tensor_card(4096, 12),
            Sharding.Tensor,
            min_nodes=3,
        )


def test_tensor_is_rejected_when_kv_heads_are_not_divisible():
    # Gemma 4 E2B has a single KV head.
    card = builtin_cards()["mlx-community/gemma-4-e2b-it-bf16"]
    with pytest.raises(PlacementError, match=r"num_key_value_heads \(1\).*divisible by 2"):
        place_instance(fully_linked(a=200, b=200), card, Sharding.Tensor, min_nodes=2)


def test_tensor_is_rejected_for_a_card_without_tensor_support():
    card = make_card(supports_tensor=False)
    with pytest.raises(PlacementError, match="does not support tensor parallelism"):
        place_instance(fully_linked(a=64, b=64), card, Sharding.Tensor, min_nodes=2)


def test_deepseek_v4_is_exempt_from_the_kv_head_rule():
    # One KV head, but its strategy splits query/output heads and MoE experts instead.
    card = builtin_cards()["mlx-community/DeepSeek-V4-Flash"]
    assert card.num_key_value_heads == 1

    instance = place_instance(fully_linked(a=100, b=100), card, Sharding.Tensor, min_nodes=2)

    assert instance.sharding == Sharding.Tensor
    assert instance.world_size == 2
    assert {(s.start_layer, s.end_layer) for s in shards_by_rank(instance)} == {(0, card.n_layers)}


def test_a_local_deepseek_v4_dir_is_exempt_too(tmp_path):
    from exo.catalog.cards import card_from_model_dir
    from exo.devtools.tiny_models import make_tiny

    card = card_from_model_dir(make_tiny(tmp_path / "acme--v4", "deepseek_v4"), "acme/v4")
    assert card.num_key_value_heads == 1 and card.supports_tensor

    instance = place_instance(fully_linked(a=100, b=100), card, Sharding.Tensor, min_nodes=2)

    assert instance.world_size == 2


def test_tensor_over_two_nodes_gives_every_rank_every_layer():
    instance = place_instance(fully_linked(a=64, b=64), tensor_card(4096, 8), Sharding.Tensor, min_nodes=2)
    shards = instance.shard_assignments.runner_to_shard.values()
    assert {(s.kind, s.start_layer, s.end_layer) for s in shards} == {("tensor", 0, 24)}
    assert sorted(s.device_rank for s in shards) == [0, 1]


def test_tensor_splits_weights_and_kv_cache_evenly():
    card = make_card(weights_gib=30, context_length=131072)  # 12 GiB of KV cache
    [preview] = instance_previews(fully_linked(a=64, b=64), card, Sharding.Tensor, min_nodes=2)
    assert preview.memory_needed_bytes == {"a": 22 * GiB, "b": 22 * GiB}


# --- rings ---------------------------------------------------------------------------------


def test_two_nodes_linked_both_ways_form_a_ring():
    card = make_card(weights_gib=30)
    instance = place_instance(fully_linked(a=20, b=20), card)
    assert sorted(nodes_by_rank(instance)) == ["a", "b"]


def test_three_nodes_linked_pairwise_form_a_ring():
    card = make_card(weights_gib=40)
    instance = place_instance(fully_linked(a=16, b=16, c=16), card)
    assert sorted(nodes_by_rank(instance)) == ["a", "b", "c"]


def test_four_nodes_in_a_square_are_ranked_along_its_sides():
    card = make_card(weights_gib=50)
    # a-b-c-d-a, without the diagonals a-c and b-d.
    state = linked(cluster(a=16, b=16, c=16, d=16), "a-b", "b-c", "c-d", "d-a")
    ranks = nodes_by_rank(place_instance(state, card))
    assert len(ranks) == 4
    for rank, node_id in enumerate(ranks):
        assert state.topology.has_edge(ranks[rank - 1], node_id)


def test_a_pair_with_a_one_way_link_is_rejected_with_the_direction():
    card = make_card(weights_gib=30)
    state = linked(cluster(a=20, b=20), "a-b", one_way=True)

    [preview] = instance_previews(state, card, Sharding.Pipeline, min_nodes=2)
    assert preview.instance is None
    assert "no cycle through a, b" in preview.error
    assert "only a -> b" in preview.error
    with pytest.raises(PlacementError, match="no cycle through a, b"):
        place_instance(state, card, min_nodes=2)


def test_three_nodes_missing_one_pair_do_not_form_a_ring():
    card = make_card(weights_gib=40)
    state = linked(cluster(a=16, b=16, c=16), "a-b", "b-c")
    [preview] = instance_previews(state, card, Sharding.Pipeline, min_nodes=3)
    assert "no link between a and c" in preview.error


def test_nodes_without_a_worker_are_not_placed_on_even_when_linked():
    card = make_card(weights_gib=30)
    state = linked(cluster(a=20, b=20), "a-ghost", "b-ghost")
    previews = instance_previews(state, card, Sharding.Pipeline)
    assert {tuple(p.node_ids) for p in previews} == {("a",), ("b",), ("a", "b")}
    assert all(p.instance is None for p in previews)


# --- hosts ---------------------------------------------------------------------------------


def two_nodes_reached_at(a_ip: str, b_ip: str) -> State:
    """Nodes a and b (20 GiB each), each reaching the other at the given address."""
    return cluster(a=20, b=20).model_copy(
        update={
            "topology": Topology(
                connections=[
                    Connection(source=NodeId("a"), sink=NodeId("b"), sink_ip=b_ip),
                    Connection(source=NodeId("b"), sink=NodeId("a"), sink_ip=a_ip),
                ]
            )
        }
    )


def test_each_rank_is_addressed_where_the_previous_rank_reached_it():
    card = make_card(weights_gib=30)
    state = two_nodes_reached_at(b_ip="192.168.1.2", a_ip="192.168.1.1")
    instance = place_instance(state, card)
    assert nodes_by_rank(instance) == ["a", "b"]
    assert instance.hosts == [f"192.168.1.1:{RING_BASE_PORT}", f"192.168.1.2:{RING_BASE_PORT + 1}"]


def test_two_ranks_on_one_ip_get_distinct_ports():
    card = make_card(weights_gib=30)
    state = two_nodes_reached_at(b_ip="127.0.0.1", a_ip="127.0.0.1")
    hosts = place_instance(state, card).hosts
    assert [host.split(":")[0] for host in hosts] == ["127.0.0.1", "127.0.0.1"]
    assert len(set(hosts)) == 2


def test_ports_of_instances_already_in_state_are_not_reused():
    card = make_card(weights_gib=30)
    state = fully_linked(a=40, b=40)
    first = place_instance(state, card, min_nodes=2)
    state = state.model_copy(update={"instances": {first.instance_id: first}})

    second = place_instance(state, card, min_nodes=2)

    first_ports = {host.rsplit(":", 1)[1] for host in first.hosts}
    second_ports = {host.rsplit(":", 1)[1] for host in second.hosts}
    assert len(second_ports) == 2
    assert first_ports.isdisjoint(second_ports)


def test_placement_from_the_same_state_picks_the_same_nodes_and_hosts():
    card = make_card(weights_gib=40)
    state = fully_linked(a=16, b=16, c=16)
    first, second = place_instance(state, card), place_instance(state, card)
    assert first.hosts == second.hosts
    assert nodes_by_rank(first) == nodes_by_rank(second)


# --- preference ----------------------------------------------------------------------------


def test_the_pair_with_the_faster_link_wins_over_the_one_with_more_memory():
    card = make_card(weights_gib=30)
    state = cluster(a=40, b=40, c=20, d=20)
    state = linked(state, "a-b", bandwidth_mbps=1_000, latency_ms=1)
    state = linked(state, "c-d", bandwidth_mbps=10_000, latency_ms=1)
    instance = place_instance(state, card, min_nodes=2)
    assert sorted(nodes_by_rank(instance)) == ["c", "d"]


def test_with_equal_bandwidth_the_lower_latency_wins():
    card = make_card(weights_gib=30)
    state = cluster(a=40, b=40, c=20, d=20)
    state = linked(state, "a-b", bandwidth_mbps=10_000, latency_ms=5)
    state = linked(state, "c-d", bandwidth_mbps=10_000, latency_ms=0.5)
    assert sorted(nodes_by_rank(place_instance(state, card, min_nodes=2))) == ["c", "d"]


def test_an_unmeasured_link_counts_as_the_slowest():
    card = make_card(weights_gib=30)
    state = cluster(a=40, b=40, c=20, d=20)
    state = linked(state, "a-b")
    state = linked(state, "c-d", bandwidth_mbps=10, latency_ms=50)
    assert sorted(nodes_by_rank(place_instance(state, card, min_nodes=2))) == ["c", "d"]


def test_with_equal_links_the_pair_with_more_free_memory_wins():
    card = make_card(weights_gib=30)
    state = cluster(a=20, b=20, c=40, d=40)
    state = linked(state, "a-b", "c-d", bandwidth_mbps=10_000, latency_ms=1)
    assert sorted(nodes_by_rank(place_instance(state, card, min_nodes=2))) == ["c", "d"]


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


def test_every_option_is_previewed_and_every_rejected_one_says_why():
    card = make_card(weights_gib=30, num_key_value_heads=3, hidden_size=4098)
    state = linked(cluster(a=20, b=20, c=8, d=64), "a-b", "b-c", "a-c")
    state = linked(state, "a-d", one_way=True)

    previews = instance_previews(state, card)

    # Every non-empty subset of four nodes, with each sharding.
    assert len(previews) == 2 * 15
    assert {p.sharding for p in previews} == {Sharding.Pipeline, Sharding.Tensor}
    for preview in previews:
        assert (preview.instance is None) != (preview.error is None)
        assert preview.error is None or preview.error.strip()
        assert set(preview.memory_needed_bytes) == set(preview.node_ids)
        assert set(preview.memory_available_bytes) == set(preview.node_ids)
    feasible = [p for p in previews if p.instance is not None]
    assert feasible, "a-b and a-b-c pipelines, and d alone, fit"
    assert previews[: len(feasible)] == feasible, "feasible options are listed first"


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
        origin_session="api-session",
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


def test_a_later_placement_does_not_reuse_the_ports_of_one_just_deleted():
    card = make_card(weights_gib=30)
    state = two_nodes_reached_at(b_ip="192.168.1.2", a_ip="192.168.1.1")
    first = place_instance(state, card).hosts
    # Same cluster a few events later (the first instance came and went).
    later = place_instance(state.model_copy(update={"last_event_applied_idx": 12}), card).hosts
    assert set(first).isdisjoint(later)


# --- instances built by hand (POST /instance) ----------------------------------------------


def with_shards(instance: Instance, **changes_by_rank: dict) -> Instance:
    """The instance with fields of rank r's shard replaced, as changes_by_rank[f"r{r}"]."""
    shards = {
        runner: shard.model_copy(update=changes_by_rank.get(f"r{shard.device_rank}", {}))
        for runner, shard in instance.shard_assignments.runner_to_shard.items()
    }
    assignments = instance.shard_assignments.model_copy(update={"runner_to_shard": shards})
    return instance.model_copy(update={"shard_assignments": assignments})


def test_placements_own_instances_have_no_problem():
    state = fully_linked(a=64, b=64, c=64, d=64)
    for sharding in (Sharding.Pipeline, Sharding.Tensor):
        instance = place_instance(state, make_card(), sharding, min_nodes=4)
        assert instance_problem(state, instance) is None


def test_hand_built_instances_that_cannot_run_are_explained():
    state = fully_linked(a=64, b=64)
    pipeline = place_instance(state, make_card(n_layers=24), Sharding.Pipeline, min_nodes=2)
    tensor = place_instance(state, make_card(), Sharding.Tensor, min_nodes=2)
    assignments = pipeline.shard_assignments
    [(first_node, first_runner), (second_node, second_runner)] = assignments.node_to_runner.items()

    ghost = assignments.model_copy(
        update={"node_to_runner": {NodeId("ghost"): first_runner, second_node: second_runner}}
    )
    assert "ghost are not in the cluster" in instance_problem(
        state, pipeline.model_copy(update={"shard_assignments": ghost})
    )

    one_node = assignments.model_copy(update={"node_to_runner": {first_node: first_runner}})
    assert "exactly one node" in instance_problem(state, pipeline.model_copy(update={"shard_assignments": one_node}))

    in_state = state.model_copy(update={"instances": {pipeline.instance_id: pipeline}})
    copy = pipeline.model_copy(update={"instance_id": InstanceId("another")})
    assert "belong to another instance" in instance_problem(in_state, copy)

    end = shards_by_rank(pipeline)[0].end_layer
    gap = with_shards(pipeline, r1={"start_layer": end + 1})
    assert "without gaps or overlaps" in instance_problem(state, gap)
    short = with_shards(pipeline, r1={"end_layer": 23})
    assert "without gaps or overlaps" in instance_problem(state, short)
    assert "every rank all 24 layers" in instance_problem(state, with_shards(tensor, r1={"start_layer": 1}))
    assert "ranks must be 0..1" in instance_problem(state, with_shards(pipeline, r1={"world_size": 3}))
    assert "one host:port per rank" in instance_problem(state, pipeline.model_copy(update={"hosts": []}))


def test_the_master_moves_ports_of_placements_made_at_once_from_one_state():
    # Two place requests at the same moment are placed from the same State, so both pick
    # the same ports; the master renumbers the second against the first.
    card = make_card(weights_gib=30)
    state = two_nodes_reached_at(b_ip="127.0.0.1", a_ip="127.0.0.1")
    first, second = place_instance(state, card), place_instance(state, card)
    assert first.hosts == second.hosts
    assert with_free_ring_ports(state, first) == first
    state = state.model_copy(update={"instances": {first.instance_id: first}})

    moved = with_free_ring_ports(state, second)

    assert [host.split(":")[0] for host in moved.hosts] == ["127.0.0.1", "127.0.0.1"]
    assert set(moved.hosts).isdisjoint(first.hosts) and len(set(moved.hosts)) == 2
    assert moved.shard_assignments == second.shard_assignments


def test_a_rank_whose_ring_port_is_taken_moves_to_a_port_no_instance_uses_nor_any_taken():
    card = make_card(weights_gib=30)
    state = two_nodes_reached_at(b_ip="127.0.0.1", a_ip="127.0.0.1")
    other = place_instance(state, card)
    state = state.model_copy(update={"instances": {other.instance_id: other}})
    instance = with_free_ring_ports(state, place_instance(state, card))
    taken_host, kept_host = instance.hosts
    avoid = set(range(RING_BASE_PORT, RING_BASE_PORT + 10))

    moved = with_ring_port_moved(state, instance, taken_host, avoid)

    new_host, same_host = moved.hosts
    new_port = int(new_host.rsplit(":", 1)[1])
    assert same_host == kept_host and new_host.startswith("127.0.0.1:")
    assert new_host not in instance.hosts and new_host not in other.hosts
    assert new_port == RING_BASE_PORT + 10  # the first port past those found taken
    assert moved.shard_assignments == instance.shard_assignments


def test_a_hand_built_instance_with_a_port_that_is_no_number_is_refused():
    card = make_card(weights_gib=30)
    state = two_nodes_reached_at(b_ip="192.168.1.2", a_ip="192.168.1.1")
    instance = place_instance(state, card)
    broken = instance.model_copy(update={"hosts": ["192.168.1.1:ring", "192.168.1.2:31001"]})
    assert instance_problem(state, broken) == "every entry of hosts must be host:port with a numeric port"


def with_engines(state: State, **engines: str) -> State:
    nodes = {
        node_id: info.model_copy(update={"engine": EngineKind(engines[node_id])})
        for node_id, info in state.nodes.items()
    }
    return state.model_copy(update={"nodes": nodes})


def test_nodes_of_different_engines_share_an_instance_on_mlx_and_the_preview_says_why():
    state = with_engines(fully_linked(a=4, b=4), a="mlx", b="llamacpp")
    card = make_card(weights_gib=4)
    instance = place_instance(state, card, min_nodes=2)
    assert instance.engine == EngineKind.Mlx
    [preview, *_] = instance_previews(state, card, Sharding.Pipeline, min_nodes=2)
    assert preview.instance is not None
    assert preview.engine_reason is not None and "a runs mlx, b runs llamacpp" in preview.engine_reason


def test_an_instance_on_llamacpp_nodes_runs_llamacpp_unless_it_cannot():
    state = with_engines(fully_linked(a=30, b=30), a="llamacpp", b="llamacpp")
    llama = make_card(weights_gib=1).model_copy(update={"family": "llama", "quantization": "4bit"})
    assert place_instance(state, llama).engine == EngineKind.LlamaCpp
    assert place_instance(state, llama, min_nodes=2).engine == EngineKind.LlamaCpp
    # A tensor split, a family the converter lacks, a quantization with no ggml twin: MLX.
    assert place_instance(state, llama, Sharding.Tensor, min_nodes=2).engine == EngineKind.Mlx
    assert place_instance(state, llama.model_copy(update={"family": "gemma4"})).engine == EngineKind.Mlx
    assert place_instance(state, llama.model_copy(update={"quantization": "3bit"})).engine == EngineKind.Mlx
    # MLX nodes run MLX whatever the model.
    assert place_instance(cluster(a=30), llama).engine == EngineKind.Mlx


# --- the vision tower ------------------------------------------------------------------


def vision_card(weights_gib: float, vision_gib: float, n_layers: int = 40) -> ModelCard:
    card = make_card(n_layers=n_layers, weights_gib=weights_gib, context_length=1024)
    return card.model_copy(update={"vision_bytes": int(vision_gib * GiB), "capabilities": ["text", "vision"]})


def two_node_preview(state: State, card: ModelCard, sharding: Sharding):
    return next(p for p in instance_previews(state, card, sharding, min_nodes=2) if p.instance is not None)


def test_rank_0_holds_the_vision_tower_and_takes_fewer_layers_for_it():
    # 40 GiB of weights, 10 of them the tower: the 40 layers share 30 GiB. Both nodes have
    # 60 GiB beyond the overhead; rank 0 keeps 10 of its for the tower.
    card = vision_card(weights_gib=40, vision_gib=10)
    preview = two_node_preview(fully_linked(a=61, b=61), card, Sharding.Pipeline)
    assert preview.instance is not None
    ranges = [(s.start_layer, s.end_layer) for s in shards_by_rank(preview.instance)]
    assert ranges == split_layers(40, [50 * GiB, 60 * GiB])
    (first, second), kv = ranges, kv_cache_bytes(card, 1024)
    rank0, rank1 = nodes_by_rank(preview.instance)
    layer_bytes = (30 * GiB + kv) * (first[1] - first[0]) // 40
    assert preview.memory_needed_bytes[rank0] == layer_bytes + 10 * GiB + RUNTIME_OVERHEAD_BYTES
    assert (
        preview.memory_needed_bytes[rank1] == (30 * GiB + kv) * (second[1] - second[0]) // 40 + RUNTIME_OVERHEAD_BYTES
    )


def test_a_model_that_fits_only_without_its_tower_is_rejected_naming_the_tower():
    card = vision_card(weights_gib=8, vision_gib=3)
    needed = (8 * GiB + kv_cache_bytes(card, 1024) + RUNTIME_OVERHEAD_BYTES) / GiB
    with pytest.raises(PlacementError) as error:
        place_instance(cluster(mini=needed - 0.5), card)
    assert "3.00 GiB vision tower" in str(error.value)
    assert f"needs {needed:.2f} GiB" in str(error.value)


def test_on_a_tensor_split_only_rank_0_adds_the_tower():
    card = vision_card(weights_gib=34, vision_gib=4, n_layers=24)
    preview = two_node_preview(fully_linked(a=64, b=64), card, Sharding.Tensor)
    assert preview.instance is not None
    rank0, rank1 = nodes_by_rank(preview.instance)
    assert preview.memory_needed_bytes[rank0] - preview.memory_needed_bytes[rank1] == 4 * GiB


def test_a_local_vlm_dirs_card_counts_its_vision_weights(tmp_path):
    """From the safetensors headers: the tower's (and Gemma 4's and Kimi-VL's projector's) tensors."""
    from safetensors import safe_open

    from exo.catalog.cards import card_from_model_dir
    from exo.devtools.tiny_vlms import make_tiny_vlm

    for name, prefixes in (
        ("gemma4_vlm", ("model.vision_tower.", "model.embed_vision.")),
        ("qwen3_vl", ("model.visual.",)),
        ("kimi_vl", ("vision_tower.", "multi_modal_projector.")),
    ):
        path = make_tiny_vlm(tmp_path / name, name)
        with safe_open(str(path / "model.safetensors"), "np") as weights:
            expected = sum(weights.get_tensor(key).nbytes for key in weights.keys() if key.startswith(prefixes))
        card = card_from_model_dir(path, f"acme/{name}")
        assert 0 < card.vision_bytes == expected < card.storage_size.in_bytes


def sealed(state: State) -> State:
    nodes = {node_id: info.model_copy(update={"sealed": True}) for node_id, info in state.nodes.items()}
    return state.model_copy(update={"nodes": nodes})


def test_with_a_cluster_secret_a_llamacpp_split_runs_mlx_and_the_preview_says_why():
    # ggml's RPC port has no authentication; the secret seals the MLX ring, not it.
    state = sealed(with_engines(fully_linked(a=30, b=30), a="llamacpp", b="llamacpp"))
    llama = make_card(weights_gib=1).model_copy(update={"family": "llama", "quantization": "4bit"})
    assert place_instance(state, llama).engine == EngineKind.LlamaCpp  # one node: no RPC
    split = two_node_preview(state, llama, Sharding.Pipeline)
    assert split.instance is not None and split.instance.engine == EngineKind.Mlx
    assert "cluster secret" in (split.engine_reason or "") and "unauthenticated" in (split.engine_reason or "")
    # A hand-built llama.cpp split is refused under the secret, allowed without it.
    hand_built = split.instance.model_copy(update={"engine": EngineKind.LlamaCpp})
    assert "cluster secret" in (instance_problem(state, hand_built) or "")
    open_state = with_engines(fully_linked(a=30, b=30), a="llamacpp", b="llamacpp")
    assert instance_problem(open_state, hand_built) is None
    assert two_node_preview(open_state, llama, Sharding.Pipeline).engine_reason is None


def test_a_llamacpp_split_of_a_model_llamacpp_refused_moves_to_mlx_on_the_same_nodes_and_layers():
    state = with_engines(fully_linked(a=30, b=30), a="llamacpp", b="llamacpp")
    llama = make_card(weights_gib=1).model_copy(update={"family": "llama", "quantization": "4bit"})
    split = two_node_preview(state, llama, Sharding.Pipeline).instance
    single = place_instance(state, llama)
    assert split is not None and split.engine == single.engine == EngineKind.LlamaCpp
    instances = {split.instance_id: split, single.instance_id: single}
    state = state.model_copy(update={"instances": instances})
    assert splits_to_move_to_mlx(state) == []

    refused = {ModelId(llama.model_id): "llama.cpp could not load the GGUF: no merges"}
    node_b = state.nodes[NodeId("b")].model_copy(update={"llamacpp_refusals": refused})
    state = state.model_copy(update={"nodes": {**state.nodes, NodeId("b"): node_b}})
    # The single runner falls back to MLX itself; only the split is placed again.
    ((old, new),) = splits_to_move_to_mlx(state)
    assert old == split and new.engine == EngineKind.Mlx
    assert new.engine_reason == "runs on MLX: llama.cpp could not load the GGUF: no merges"

    def layers(instance: Instance) -> dict[NodeId, tuple[int, int, int]]:
        shards = instance.shard_assignments.runner_to_shard
        return {
            node_id: (shards[runner_id].device_rank, shards[runner_id].start_layer, shards[runner_id].end_layer)
            for node_id, runner_id in instance.shard_assignments.node_to_runner.items()
        }

    assert layers(new) == layers(split) and new.instance_id != split.instance_id
    assert not set(new.shard_assignments.runner_to_shard) & set(split.shard_assignments.runner_to_shard)
    # Other ports: the old ranks may still hold theirs.
    assert [h.rsplit(":", 1)[0] for h in new.hosts] == [h.rsplit(":", 1)[0] for h in split.hosts]
    assert not {h.rsplit(":", 1)[1] for h in new.hosts} & {h.rsplit(":", 1)[1] for h in split.hosts}


def test_the_preview_says_why_an_instance_on_llamacpp_nodes_runs_mlx():
    state = with_engines(fully_linked(a=30, b=30), a="llamacpp", b="llamacpp")
    gemma = make_card(weights_gib=1).model_copy(update={"family": "gemma4", "quantization": "4bit"})
    (preview, *_) = [p for p in instance_previews(state, gemma, Sharding.Pipeline) if p.instance is not None]
    assert preview.instance is not None and preview.instance.engine == EngineKind.Mlx
    assert (preview.engine_reason or "").startswith("runs on MLX: ")


def test_a_llamacpp_splits_rank_0_fetches_every_layer_and_an_mlx_pipelines_its_own():
    # llama.cpp's rank 0 loads the whole GGUF and offloads the followers' layers by RPC:
    # a follower fetches no weights (an empty range).
    llama = make_card(weights_gib=1).model_copy(update={"family": "llama", "quantization": "4bit"})
    for engine, rank_0_layers in (("llamacpp", None), ("mlx", "own")):
        instance = place_instance(with_engines(fully_linked(a=30, b=30), a=engine, b=engine), llama, min_nodes=2)
        first, second = shards_by_rank(instance)
        rank_0, rank_1 = nodes_by_rank(instance)
        own = (first.start_layer, first.end_layer)
        assert layers_needed(instance, rank_0) == (None if rank_0_layers is None else own)
        follower_end = second.start_layer if engine == "llamacpp" else second.end_layer
        assert layers_needed(instance, rank_1) == (second.start_layer, follower_end)


# --- disaggregated serving (issue 36) ----------------------------------------------------------


def test_asked_disaggregation_places_the_model_whole_on_both_nodes_linked_by_a_port(small_card: ModelCard):
    state = linked(cluster(a=20, b=20), "a-b")
    decode, prefill = place_disaggregated(state, small_card, NodeId("a"), NodeId("b"), min_tokens=1000)
    assert list(decode.shard_assignments.node_to_runner) == ["b"]
    assert list(prefill.shard_assignments.node_to_runner) == ["a"]
    for instance in (decode, prefill):
        [shard] = instance.shard_assignments.runner_to_shard.values()
        assert (shard.start_layer, shard.end_layer) == (0, small_card.n_layers)
        assert instance.engine == EngineKind.Mlx
    assert decode.prefill is not None and prefill.prefill_for is not None
    assert prefill.prefill_for.instance_id == decode.instance_id
    # b reaches a at a's address, on the port a's runner listens on.
    assert decode.prefill == PrefillPlacement(
        instance_id=prefill.instance_id, host=f"10.0.0.1:{prefill.prefill_for.port}", min_tokens=1000
    )
    # A later ring does not take that port.
    later = state.model_copy(update={"instances": {i.instance_id: i for i in (decode, prefill)}})
    next_prefill = place_disaggregated(later, small_card, NodeId("a"), NodeId("b"))[1].prefill_for
    assert next_prefill is not None and next_prefill.port != prefill.prefill_for.port


def test_disaggregation_needs_two_linked_nodes_that_each_hold_the_model(small_card: ModelCard):
    with pytest.raises(PlacementError, match="must differ"):
        place_disaggregated(linked(cluster(a=20, b=20), "a-b"), small_card, NodeId("a"), NodeId("a"))
    with pytest.raises(PlacementError, match="has not reached"):
        place_disaggregated(cluster(a=20, b=20), small_card, NodeId("a"), NodeId("b"))
    with pytest.raises(PlacementError, match="on node a"):
        place_disaggregated(linked(cluster(a=0.1, b=20), "a-b"), small_card, NodeId("a"), NodeId("b"))


def test_requests_never_go_to_an_instance_that_only_prefills(small_card: ModelCard):
    state = load_state(small_card, {"decode": RunnerReady(), "prefill": RunnerReady()}, [task_on("decode", 1)])
    prefill = state.instances[InstanceId("prefill")].model_copy(
        update={"prefill_for": PrefillFor(instance_id=InstanceId("decode"), port=31000)}
    )
    state = state.model_copy(update={"instances": {**state.instances, prefill.instance_id: prefill}})
    assert least_loaded_instance(state, ModelId(small_card.model_id)) == "decode"
