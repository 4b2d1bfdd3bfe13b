"""The only way State changes: a pure function of (State, IndexedEvent)."""

from typing import TypeVar, assert_never

from exo.shared.types.common import ModelId
from exo.shared.types.downloads import DownloadCancelled, DownloadFailed, DownloadOrderEntry
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
from exo.shared.types.state import MAX_DELETION_REASONS, State

K = TypeVar("K")
V = TypeVar("V")


class EventOrderError(ValueError):
    """An event arrived with an index other than the next one."""


def apply(state: State, indexed: IndexedEvent) -> State:
    expected = state.last_event_applied_idx + 1
    if indexed.idx != expected:
        raise EventOrderError(f"expected event {expected}, got {indexed.idx}")
    new_state = apply_event(state, indexed.event)
    return new_state.model_copy(update={"last_event_applied_idx": indexed.idx})


def apply_event(state: State, event: Event) -> State:
    match event:
        case MasterElected(node_id=node_id):
            return state.model_copy(update={"master_node_id": node_id})
        case NodeGatheredInfo(info=info):
            return state.model_copy(update={"nodes": {**state.nodes, info.node_id: info}})
        case NodeTimedOut(node_id=node_id):
            return state.model_copy(
                update={
                    "nodes": _without(state.nodes, node_id),
                    "downloads": _without(state.downloads, node_id),
                    "download_orders": _without(state.download_orders, node_id),
                    "topology": state.topology.without_node(node_id),
                }
            )
        case InstanceCreated(instance=instance):
            instances = {**state.instances, instance.instance_id: instance}
            return state.model_copy(update={"instances": instances})
        case InstanceDeleted(instance_id=instance_id, reason=reason):
            instance = state.instances.get(instance_id)
            if instance is None:
                return state
            gone = instance.shard_assignments.runner_to_shard.keys()
            deletions = list({**_without(state.instance_deletions, instance_id), instance_id: reason}.items())
            return state.model_copy(
                update={
                    "instances": _without(state.instances, instance_id),
                    "runners": {r: s for r, s in state.runners.items() if r not in gone},
                    "instance_deletions": dict(deletions[-MAX_DELETION_REASONS:]),
                }
            )
        case InstanceRingMoved(instance_id=instance_id, hosts=hosts):
            instance = state.instances.get(instance_id)
            if instance is None:
                return state
            moved = instance.model_copy(update={"hosts": hosts})
            return state.model_copy(update={"instances": {**state.instances, instance_id: moved}})
        case CustomModelCardAdded(card=card):
            cards = {**state.custom_model_cards, ModelId(card.model_id): card}
            return state.model_copy(update={"custom_model_cards": cards})
        case CustomModelCardDeleted(model_id=model_id):
            return state.model_copy(update={"custom_model_cards": _without(state.custom_model_cards, model_id)})
        case RunnerStatusUpdated(runner_id=runner_id, status=status):
            if not any(runner_id in i.shard_assignments.runner_to_shard for i in state.instances.values()):
                return state  # a late report from a runner of a deleted instance
            return state.model_copy(update={"runners": {**state.runners, runner_id: status}})
        case TaskCreated(task=task):
            return state.model_copy(update={"tasks": {**state.tasks, task.task_id: task}})
        case TaskStatusUpdated(task_id=task_id, status=status, error_message=error):
            task = state.tasks.get(task_id)
            if task is None:
                return state
            updated = task.model_copy(update={"status": status, "error_message": error})
            return state.model_copy(update={"tasks": {**state.tasks, task_id: updated}})
        case TaskDeleted(task_id=task_id):
            return state.model_copy(update={"tasks": _without(state.tasks, task_id)})
        case NodeDownloadProgress(node_id=node_id, model_id=model_id, progress=progress):
            node_downloads = {**state.downloads.get(node_id, {}), model_id: progress}
            return state.model_copy(update={"downloads": {**state.downloads, node_id: node_downloads}})
        case DownloadOrdered():
            return _with_download_order(state, event)
        case NodeDownloadDeleted(node_id=node_id, model_id=model_id):
            downloads = {**state.downloads, node_id: _without(state.downloads.get(node_id, {}), model_id)}
            orders = {**state.download_orders, node_id: _without(state.download_orders.get(node_id, {}), model_id)}
            return state.model_copy(update={"downloads": downloads, "download_orders": orders})
        case TopologyEdgeUpdated(connection=connection):
            return state.model_copy(update={"topology": state.topology.with_connection(connection)})
        case TopologyEdgeDeleted(source=source, sink=sink):
            return state.model_copy(update={"topology": state.topology.without_edge(source, sink)})
        case _:
            assert_never(event)


def _with_download_order(state: State, event: DownloadOrdered) -> State:
    node_id, model_id = event.node_id, event.model_id
    entry = DownloadOrderEntry(order=event.order, layers=event.layers)
    orders = {**state.download_orders, node_id: {**state.download_orders.get(node_id, {}), model_id: entry}}
    records = state.downloads.get(node_id, {})
    if event.order == "start" and isinstance(records.get(model_id), DownloadFailed | DownloadCancelled):
        # The record of an attempt that ended goes, so the worker starts again.
        downloads = {**state.downloads, node_id: _without(records, model_id)}
        return state.model_copy(update={"download_orders": orders, "downloads": downloads})
    return state.model_copy(update={"download_orders": orders})


def _without(mapping: dict[K, V], key: K) -> dict[K, V]:
    return {k: v for k, v in mapping.items() if k != key}
