"""Questions every layer asks of State, answered in one place. Pure functions of State,
beside `apply`, so the master, the worker and the API agree on what "serving" means."""

from exo.shared.models.weight_files import files_for_layers
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.downloads import (
    DownloadCancelled,
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
)
from exo.shared.types.instances import EngineKind, Instance
from exo.shared.types.runners import SERVING_STATUSES, RunnerFailed, RunnerLoading, RunnerStatus
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import FINISHED_TASK_STATUSES


def runner_statuses(state: State, instance: Instance) -> dict[str, RunnerStatus | None]:
    """Each runner of the instance and its status (None before its first report)."""
    return {runner_id: state.runners.get(runner_id) for runner_id in instance.shard_assignments.runner_to_shard}


def is_serving(state: State, instance: Instance) -> bool:
    """Every runner of the instance has loaded and warmed up."""
    return all(isinstance(status, SERVING_STATUSES) for status in runner_statuses(state, instance).values())


def runner_failures(state: State, instance: Instance) -> list[str]:
    return [s.error_message for s in runner_statuses(state, instance).values() if isinstance(s, RunnerFailed)]


def instances_of(state: State, model_id: str) -> list[Instance]:
    return [instance for instance in state.instances.values() if instance.model_id == model_id]


def weights_converted(state: State, instance: Instance) -> tuple[int, int] | None:
    """(written, total) bytes of the weights the instance's runners are converting for
    their engine, else None."""
    statuses = runner_statuses(state, instance).values()
    converting = [s for s in statuses if isinstance(s, RunnerLoading) and s.total_convert_bytes]
    if not converting:
        return None
    return sum(s.converted_bytes for s in converting), sum(s.total_convert_bytes for s in converting)


def layers_loaded(state: State, instance: Instance) -> tuple[int, int] | None:
    """(loaded, total) layers over the instance's runners that are loading, else None."""
    loading = [s for s in runner_statuses(state, instance).values() if isinstance(s, RunnerLoading) and s.total_layers]
    if not loading:
        return None
    return sum(s.layers_loaded for s in loading), sum(s.total_layers for s in loading)


def open_task_count(state: State, instance_id: InstanceId) -> int:
    return sum(
        1
        for task in state.tasks.values()
        if task.instance_id == instance_id and task.status not in FINISHED_TASK_STATUSES
    )


def least_loaded_instance(state: State, model_id: ModelId) -> InstanceId | None:
    """The serving instance of this model with the fewest unfinished tasks (not one that
    only prefills for another)."""
    candidates = [
        i.instance_id for i in instances_of(state, model_id) if is_serving(state, i) and i.prefill_for is None
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda instance_id: (open_task_count(state, instance_id), instance_id))


def has_task_for(state: State, command_id: CommandId) -> bool:
    """The master has made a task of this command that has not finished."""
    return any(
        task.command_id == command_id and task.status not in FINISHED_TASK_STATUSES for task in state.tasks.values()
    )


def instance_using_files(state: State, node_id: NodeId, model_id: str) -> Instance | None:
    """An instance with a runner on that node running the model, which needs its files."""
    for instance in instances_of(state, model_id):
        if node_id in instance.shard_assignments.node_to_runner:
            return instance
    return None


def download_running(state: State, node_id: NodeId, model_id: str) -> bool:
    return isinstance(state.downloads.get(node_id, {}).get(ModelId(model_id)), DownloadPending | DownloadOngoing)


def layers_needed(instance: Instance, node_id: NodeId) -> tuple[int, int] | None:
    """The layer range of the model's weights the node's rank of the instance reads; None:
    every layer; an empty range: no weights (its config and tokenizer only)."""
    shard = instance.shard_assignments.runner_to_shard[instance.shard_assignments.node_to_runner[node_id]]
    if instance.engine == EngineKind.LlamaCpp and instance.world_size > 1:
        # llama.cpp's rank 0 loads the whole model and sends the followers' layers to their
        # RPC servers: it needs every layer's weights, and a follower none.
        return None if shard.device_rank == 0 else (shard.start_layer, shard.start_layer)
    if isinstance(shard, PipelineShardMetadata) and (shard.start_layer, shard.end_layer) != (0, shard.n_layers):
        return shard.start_layer, shard.end_layer
    return None


def nodes_fetching(state: State, model_id: str) -> dict[NodeId, list[tuple[int, int] | None]]:
    """The nodes that need files of the model they do not hold (a runner of one of its
    instances, or a start order), each with the layer ranges it needs (None: all), and
    whose download has not failed or been cancelled."""
    wanted: dict[NodeId, list[tuple[int, int] | None]] = {}
    for instance in instances_of(state, model_id):
        for node_id in instance.shard_assignments.node_to_runner:
            wanted.setdefault(node_id, []).append(layers_needed(instance, node_id))
    for node_id, orders in state.download_orders.items():
        entry = orders.get(ModelId(model_id))
        if entry is not None and entry.order == "start":
            wanted.setdefault(node_id, []).append(entry.layers)
    fetching = {}
    for node_id, ranges in wanted.items():
        record = state.downloads.get(node_id, {}).get(ModelId(model_id))
        if node_id not in state.nodes or isinstance(record, DownloadFailed | DownloadCancelled):
            continue
        if isinstance(record, DownloadCompleted) and all(
            layers is None and record.layers is None or layers is not None and record.covers(*layers)
            for layers in ranges
        ):
            continue
        fetching[node_id] = ranges
    return fetching


def hub_fetcher(state: State, model_id: str, file: str, weight_map: dict[str, str] | None) -> NodeId | None:
    """Of the nodes that need `file` of the model and have no copy, the one that takes it
    from the hub: the lowest node id. The others take it from that node while it arrives,
    so the hub sends each file once. Every node answers the same from the same State.
    `weight_map`: the model's safetensors index (None: every node needs every file)."""
    # Which rank is the last one is the model's layer count (its card's), not the index's.
    shards = [
        s for instance in instances_of(state, model_id) for s in instance.shard_assignments.runner_to_shard.values()
    ]
    n_layers = shards[0].n_layers if shards else None
    needers = []
    for node_id, ranges in nodes_fetching(state, model_id).items():
        record = state.downloads.get(node_id, {}).get(ModelId(model_id))
        if isinstance(record, DownloadCompleted) and file in record.files:
            continue
        if (
            weight_map is None
            or not file.endswith(".safetensors")
            or any(file in files_for_layers(weight_map, layers, n_layers) for layers in ranges)
        ):
            needers.append(node_id)
    return min(needers, default=None)


def _gave_up_prefix(model_id: str) -> str:
    return f"the runner of {model_id} failed "


def gave_up_reason(model_id: str, attempts: int, detail: str) -> str:
    """Why a worker deleted an instance whose runner kept failing (read back by gave_up_on)."""
    return f"{_gave_up_prefix(model_id)}{attempts} times, last: {detail}"


def gave_up_on(state: State, model_id: str) -> tuple[InstanceId, str] | None:
    """The latest instance of the model State remembers deleting because its runner kept
    failing, with the reason."""
    for instance_id, reason in reversed(state.instance_deletions.items()):
        if reason.startswith(_gave_up_prefix(model_id)):
            return instance_id, reason
    return None
