"""State changes only through apply: events in index order, one short case per event
kind, the input State left untouched, and everything survives a trip through JSON."""

import json
import typing

import pytest

from exo.catalog.cards import builtin_cards
from exo.shared.apply import EventOrderError, apply, apply_event
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import (
    CommandId,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.downloads import (
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
)
from exo.shared.types.events import (
    CustomModelCardAdded,
    CustomModelCardDeleted,
    DownloadOrdered,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceRingMoved,
    MasterElected,
    NodeDownloadDeleted,
    NodeDownloadProgress,
    NodeGatheredInfo,
    NodeTimedOut,
    RunnerStatusUpdated,
    TaskCreated,
    TaskDeleted,
    TaskStatusUpdated,
    TopologyEdgeDeleted,
    TopologyEdgeUpdated,
)
from exo.shared.types.instances import Instance, ShardAssignments, Sharding
from exo.shared.types.nodes import MemoryInfo, NodeInfo
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerFailed,
    RunnerIdle,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
)
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.shared.types.topology import Connection

GiB = 2**30
NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")


@pytest.fixture
def card() -> ModelCard:
    return builtin_cards()["mlx-community/DeepSeek-V4-Flash"]


def node_info(node_id: NodeId) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        friendly_name=f"{node_id}'s Mac",
        os="macOS",
        backend="metal",
        cpu_count=16,
        memory=MemoryInfo(total_bytes=512 * GiB, available_bytes=400 * GiB),
        disk_available_bytes=2000 * GiB,
        api_port=52415,
    )


def two_rank_instance(card: ModelCard, instance_id: str, runners: tuple[str, str]) -> Instance:
    """A pipeline instance with its layers split between node-a and node-b."""
    half = card.n_layers // 2
    ranges = [(0, half), (half, card.n_layers)]
    return Instance(
        instance_id=InstanceId(instance_id),
        sharding=Sharding.Pipeline,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id),
            runner_to_shard={
                RunnerId(runner): PipelineShardMetadata(
                    model_card=card,
                    device_rank=rank,
                    world_size=2,
                    start_layer=start,
                    end_layer=end,
                    n_layers=card.n_layers,
                )
                for rank, (runner, (start, end)) in enumerate(zip(runners, ranges, strict=True))
            },
            node_to_runner={NODE_A: RunnerId(runners[0]), NODE_B: RunnerId(runners[1])},
        ),
        hosts=["10.0.0.1:5000", "10.0.0.2:5000"],
    )


def task(instance_id: str, task_id: str = "task-1") -> TextGenerationTask:
    return TextGenerationTask(
        task_id=TaskId(task_id),
        command_id=CommandId(f"command-of-{task_id}"),
        instance_id=InstanceId(instance_id),
        origin_session="api-session",
        params=TextGenerationTaskParams(
            model=ModelId("mlx-community/DeepSeek-V4-Flash"),
            messages=[ChatMessage(role="user", content="Why is the sky blue?")],
            max_tokens=64,
            stop=["\n\n"],
        ),
    )


def apply_all(state: State, *events: Event) -> State:
    for event in events:
        state = apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))
    return state


@pytest.fixture
def serving_state(card: ModelCard) -> State:
    """Two nodes, one instance over both with its runners Ready, one pending task, and
    node-a's download finished."""
    return apply_all(
        State(),
        MasterElected(node_id=NODE_A),
        NodeGatheredInfo(info=node_info(NODE_A)),
        NodeGatheredInfo(info=node_info(NODE_B)),
        InstanceCreated(instance=two_rank_instance(card, "inst-1", ("runner-a", "runner-b"))),
        RunnerStatusUpdated(runner_id=RunnerId("runner-a"), status=RunnerReady()),
        RunnerStatusUpdated(runner_id=RunnerId("runner-b"), status=RunnerRunning(active_tasks=2)),
        TaskCreated(task=task("inst-1")),
        NodeDownloadProgress(
            node_id=NODE_A,
            model_id=ModelId(card.model_id),
            progress=DownloadCompleted(total_bytes=card.storage_size.in_bytes, path="/models/v4"),
        ),
    )


# --- event order ---------------------------------------------------------------------


def test_events_applied_in_index_order_advance_last_applied_idx():
    state = State()
    for idx in range(3):
        state = apply(state, IndexedEvent(idx=idx, event=MasterElected(node_id=NODE_A)))
    assert state.last_event_applied_idx == 2


def test_skipped_index_is_rejected():
    state = apply(State(), IndexedEvent(idx=0, event=MasterElected(node_id=NODE_A)))
    with pytest.raises(EventOrderError):
        apply(state, IndexedEvent(idx=2, event=MasterElected(node_id=NODE_B)))


def test_repeated_index_is_rejected():
    state = apply(State(), IndexedEvent(idx=0, event=MasterElected(node_id=NODE_A)))
    with pytest.raises(EventOrderError):
        apply(state, IndexedEvent(idx=0, event=MasterElected(node_id=NODE_B)))


def test_first_event_must_have_index_zero():
    with pytest.raises(EventOrderError):
        apply(State(), IndexedEvent(idx=1, event=MasterElected(node_id=NODE_A)))


# --- each event kind -----------------------------------------------------------------


def test_master_elected_records_the_master():
    state = apply_all(State(), MasterElected(node_id=NODE_A), MasterElected(node_id=NODE_B))
    assert state.master_node_id == NODE_B


def test_node_gathered_info_adds_or_replaces_the_node():
    updated = node_info(NODE_A).model_copy(update={"friendly_name": "renamed"})
    state = apply_all(
        State(),
        NodeGatheredInfo(info=node_info(NODE_A)),
        NodeGatheredInfo(info=updated),
    )
    assert state.nodes == {NODE_A: updated}


def test_node_timed_out_removes_the_node_and_its_downloads(serving_state: State, card: ModelCard):
    state = apply_all(
        serving_state,
        NodeDownloadProgress(node_id=NODE_B, model_id=ModelId(card.model_id), progress=DownloadPending()),
        NodeTimedOut(node_id=NODE_A),
    )
    assert NODE_A not in state.nodes
    assert NODE_A not in state.downloads
    assert NODE_B in state.nodes
    assert NODE_B in state.downloads


def test_instance_created_adds_the_instance(card: ModelCard):
    instance = two_rank_instance(card, "inst-1", ("runner-a", "runner-b"))
    state = apply_all(State(), InstanceCreated(instance=instance))
    assert state.instances == {InstanceId("inst-1"): instance}


def test_instance_ring_moved_changes_only_the_hosts(serving_state: State):
    (instance_id, instance) = next(iter(serving_state.instances.items()))
    moved = apply_event(serving_state, InstanceRingMoved(instance_id=instance_id, hosts=["10.0.0.1:31009"]))
    assert moved.instances[instance_id] == instance.model_copy(update={"hosts": ["10.0.0.1:31009"]})
    assert moved.runners == serving_state.runners
    unknown = InstanceRingMoved(instance_id=InstanceId("gone"), hosts=["10.0.0.1:31009"])
    assert apply_event(serving_state, unknown) == serving_state


def test_instance_deleted_removes_the_instance_and_only_its_runners(serving_state: State, card: ModelCard):
    state = apply_all(
        serving_state,
        InstanceCreated(instance=two_rank_instance(card, "inst-2", ("runner-c", "runner-d"))),
        RunnerStatusUpdated(runner_id=RunnerId("runner-c"), status=RunnerIdle()),
        InstanceDeleted(instance_id=InstanceId("inst-1"), reason="deleted by request"),
    )
    assert set(state.instances) == {InstanceId("inst-2")}
    assert set(state.runners) == {RunnerId("runner-c")}


def test_instance_deleted_for_unknown_instance_changes_nothing_but_the_index(
    serving_state: State,
):
    state = apply_all(serving_state, InstanceDeleted(instance_id=InstanceId("no-such-instance")))
    assert state == serving_state.model_copy(
        update={"last_event_applied_idx": serving_state.last_event_applied_idx + 1}
    )


def test_runner_status_updated_sets_the_status_of_an_instance_runner(
    serving_state: State,
):
    state = apply_all(
        serving_state,
        RunnerStatusUpdated(runner_id=RunnerId("runner-a"), status=RunnerFailed(error_message="oom")),
    )
    assert state.runners[RunnerId("runner-a")] == RunnerFailed(error_message="oom")


def test_runner_status_updated_for_a_runner_of_no_instance_is_ignored(
    serving_state: State,
):
    state = apply_all(
        serving_state,
        RunnerStatusUpdated(runner_id=RunnerId("runner-of-deleted"), status=RunnerReady()),
    )
    assert RunnerId("runner-of-deleted") not in state.runners
    assert state.runners == serving_state.runners


def test_task_created_adds_the_task_pending():
    state = apply_all(State(), TaskCreated(task=task("inst-1", "task-9")))
    assert state.tasks[TaskId("task-9")].status == TaskStatus.Pending


def test_task_status_updated_sets_status_and_error(serving_state: State):
    state = apply_all(
        serving_state,
        TaskStatusUpdated(
            task_id=TaskId("task-1"),
            status=TaskStatus.Failed,
            error_message="runner died",
        ),
    )
    updated = state.tasks[TaskId("task-1")]
    assert (updated.status, updated.error_message) == (TaskStatus.Failed, "runner died")


def test_task_status_updated_on_unknown_task_is_a_no_op(serving_state: State):
    state = apply_all(
        serving_state,
        TaskStatusUpdated(task_id=TaskId("no-such-task"), status=TaskStatus.Complete),
    )
    assert state.tasks == serving_state.tasks


def test_task_deleted_removes_the_task(serving_state: State):
    state = apply_all(serving_state, TaskDeleted(task_id=TaskId("task-1")))
    assert state.tasks == {}


def test_node_download_progress_records_progress_per_node_and_model(serving_state: State, card: ModelCard):
    other_model = ModelId("mlx-community/Qwen3.5-2B-MLX-8bit")
    ongoing = DownloadOngoing(downloaded_bytes=GiB, total_bytes=3 * GiB, bytes_per_second=1e8)
    state = apply_all(
        serving_state,
        NodeDownloadProgress(node_id=NODE_A, model_id=other_model, progress=ongoing),
    )
    assert state.downloads[NODE_A][other_model] == ongoing
    assert state.downloads[NODE_A][ModelId(card.model_id)] == serving_state.downloads[NODE_A][ModelId(card.model_id)]


def test_node_download_progress_replaces_earlier_progress(card: ModelCard):
    model_id = ModelId(card.model_id)
    state = apply_all(
        State(),
        NodeDownloadProgress(node_id=NODE_A, model_id=model_id, progress=DownloadPending()),
        NodeDownloadProgress(
            node_id=NODE_A,
            model_id=model_id,
            progress=DownloadFailed(error_message="404"),
        ),
    )
    assert state.downloads == {NODE_A: {model_id: DownloadFailed(error_message="404")}}


# --- purity --------------------------------------------------------------------------


def one_of_each_event(card: ModelCard) -> list[Event]:
    model_id = ModelId(card.model_id)
    return [
        MasterElected(node_id=NODE_B),
        NodeGatheredInfo(info=node_info(NodeId("node-c"))),
        NodeTimedOut(node_id=NODE_B),
        InstanceCreated(instance=two_rank_instance(card, "inst-2", ("runner-c", "runner-d"))),
        InstanceDeleted(instance_id=InstanceId("inst-1"), reason="node-b timed out"),
        InstanceRingMoved(instance_id=InstanceId("inst-2"), hosts=["10.0.0.1:31004", "10.0.0.2:31001"]),
        RunnerStatusUpdated(
            runner_id=RunnerId("runner-c"),
            status=RunnerLoading(layers_loaded=3, total_layers=21),
        ),
        TaskCreated(task=task("inst-2", "task-2")),
        TaskStatusUpdated(task_id=TaskId("task-2"), status=TaskStatus.Running),
        TaskDeleted(task_id=TaskId("task-2")),
        NodeDownloadProgress(
            node_id=NODE_A,
            model_id=model_id,
            progress=DownloadOngoing(downloaded_bytes=10, total_bytes=100),
        ),
        DownloadOrdered(node_id=NODE_A, model_id=model_id, order="start"),
        NodeDownloadDeleted(node_id=NODE_A, model_id=model_id),
        TopologyEdgeUpdated(
            connection=Connection(source=NODE_A, sink=NODE_B, sink_ip="10.0.0.2", latency_ms=0.4, bandwidth_mbps=9400)
        ),
        TopologyEdgeDeleted(source=NODE_B, sink=NODE_A),
        CustomModelCardAdded(card=card),
        CustomModelCardDeleted(model_id=ModelId(card.model_id)),
    ]


def test_apply_never_mutates_the_input_state(serving_state: State, card: ModelCard):
    events = one_of_each_event(card)
    # Each event gets the untouched state fixture, so every case's update is checked.
    for event in events:
        before = serving_state.model_copy(deep=True)
        apply(
            serving_state,
            IndexedEvent(idx=serving_state.last_event_applied_idx + 1, event=event),
        )
        assert serving_state == before, type(event).__name__


# --- JSON ----------------------------------------------------------------------------


def test_one_of_each_event_covers_the_whole_event_union(card: ModelCard):
    union_members = set(typing.get_args(typing.get_args(Event)[0]))
    assert {type(event) for event in one_of_each_event(card)} == union_members


def test_every_event_type_round_trips_through_json_inside_an_indexed_event(
    card: ModelCard,
):
    for idx, event in enumerate(one_of_each_event(card)):
        indexed = IndexedEvent(idx=idx, event=event)
        assert IndexedEvent.model_validate_json(indexed.model_dump_json()) == indexed, event.kind


def test_a_non_trivial_state_round_trips_through_json(serving_state: State, card: ModelCard):
    state = apply_all(
        serving_state,
        InstanceCreated(instance=two_rank_instance(card, "inst-2", ("runner-c", "runner-d"))),
        RunnerStatusUpdated(runner_id=RunnerId("runner-c"), status=RunnerConnected()),
        RunnerStatusUpdated(
            runner_id=RunnerId("runner-d"),
            status=RunnerFailed(error_message="oom", attempt=2),
        ),
        NodeDownloadProgress(
            node_id=NODE_B,
            model_id=ModelId(card.model_id),
            progress=DownloadOngoing(downloaded_bytes=GiB, total_bytes=2 * GiB, bytes_per_second=5e7),
        ),
    )
    assert len({type(status) for status in state.runners.values()}) == 4
    assert State.model_validate_json(state.model_dump_json()) == state


def test_state_json_uses_camel_case_keys(serving_state: State):
    wire = json.loads(serving_state.model_dump_json())
    assert "lastEventAppliedIdx" in wire
    assert "masterNodeId" in wire
    assert "last_event_applied_idx" not in wire
    instance = wire["instances"]["inst-1"]
    assert "shardAssignments" in instance
    assert "runnerToShard" in instance["shardAssignments"]
    assert "apiPort" in wire["nodes"][NODE_A]


def test_custom_model_cards_are_added_and_deleted(card: ModelCard):
    added = apply_event(State(), CustomModelCardAdded(card=card))
    assert added.custom_model_cards == {card.model_id: card}
    assert apply_event(added, CustomModelCardDeleted(model_id=ModelId(card.model_id))).custom_model_cards == {}


def test_instance_deletion_reasons_are_kept_for_the_most_recent_instances(card: ModelCard):
    state = State()
    for number in range(40):
        instance = two_rank_instance(card, f"i{number}", (f"r{number}a", f"r{number}b"))
        state = apply_event(state, InstanceCreated(instance=instance))
        state = apply_event(state, InstanceDeleted(instance_id=instance.instance_id, reason=f"reason {number}"))
    assert len(state.instance_deletions) == 32
    assert state.instance_deletions[InstanceId("i39")] == "reason 39"
    assert InstanceId("i0") not in state.instance_deletions
