"""What this node's worker should do next: a pure function of State and of what the
worker knows about its own runner processes."""

from dataclasses import dataclass

from exo.shared.queries import download_running, gave_up_reason, instance_using_files, layers_needed
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.downloads import DownloadCancelled, DownloadCompleted, DownloadFailed, DownloadProgress
from exo.shared.types.instances import Instance
from exo.shared.types.runners import (
    SERVING_STATUSES,
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskStatus
from exo.worker.runner_protocol import ConnectToGroup, LifecycleInstruction, LoadModel, RunnerInstruction, StartWarmup

MAX_RUNNER_ATTEMPTS = 3
# What MLX's ring backend raises when its port is bound already (errno 98, EADDRINUSE).
RING_BIND_FAILURE = "Couldn't bind socket (error: 98)"
RESTART_BACKOFF_SECONDS = 2.0


@dataclass(frozen=True)
class LocalRunner:
    """The worker's own view of one runner process."""

    runner_id: RunnerId
    instance_id: InstanceId
    sent: frozenset[type[RunnerInstruction]]
    forwarded: frozenset[TaskId]
    in_flight: frozenset[TaskId]
    exited: bool
    exited_at: float | None
    attempt: int
    # The instance's ring addresses the process was started with.
    hosts: tuple[str, ...] = ()
    # Its own account of why it failed, once it has.
    failure: str | None = None
    # The last status the process reported (State has it once the master ordered it).
    status: RunnerStatus | None = None


@dataclass(frozen=True)
class CreateRunner:
    instance_id: InstanceId
    runner_id: RunnerId
    attempt: int = 1


@dataclass(frozen=True)
class ShutdownRunner:
    runner_id: RunnerId


@dataclass(frozen=True)
class AbandonRunner:
    """Another rank of the runner's group failed: a ring never recovers a lost member,
    so kill the runner now (it may be blocked waiting on the dead peer) and fail what it
    was serving with `reason`."""

    runner_id: RunnerId
    reason: str


@dataclass(frozen=True)
class DeleteFailedInstance:
    instance_id: InstanceId
    reason: str


@dataclass(frozen=True)
class ReportRingPortTaken:
    """The runner could not bind its ring port: ask the master for another."""

    instance_id: InstanceId
    runner_id: RunnerId


@dataclass(frozen=True)
class FindModel:
    instance_id: InstanceId
    # Its draft model (rank 0's node fetches it whole), not the model itself.
    draft: bool = False


@dataclass(frozen=True)
class RunnerStep:
    runner_id: RunnerId
    instruction: LifecycleInstruction


@dataclass(frozen=True)
class ForwardTask:
    runner_id: RunnerId
    task_id: TaskId


@dataclass(frozen=True)
class CancelTask:
    runner_id: RunnerId
    task_id: TaskId


@dataclass(frozen=True)
class StartModelDownload:
    model_id: ModelId
    # The layers whose files to fetch; None: the whole model.
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class CancelModelDownload:
    model_id: ModelId


@dataclass(frozen=True)
class DeleteModelFiles:
    model_id: ModelId


PlannerAction = (
    CreateRunner
    | ShutdownRunner
    | AbandonRunner
    | DeleteFailedInstance
    | ReportRingPortTaken
    | FindModel
    | RunnerStep
    | ForwardTask
    | CancelTask
    | StartModelDownload
    | CancelModelDownload
    | DeleteModelFiles
)


def plan(
    node_id: NodeId,
    state: State,
    local: dict[RunnerId, LocalRunner],
    now: float,
    downloading: frozenset[ModelId] = frozenset(),
) -> PlannerAction | None:
    """`downloading`: models this worker process is downloading right now."""
    for runner in local.values():
        if runner.instance_id not in state.instances and not runner.exited:
            return ShutdownRunner(runner.runner_id)

    for instance in state.instances.values():
        runner_id = instance.shard_assignments.node_to_runner.get(node_id)
        if runner_id is None:
            continue
        action = _plan_instance(node_id, state, instance, runner_id, local.get(runner_id), now, downloading)
        if action is not None:
            return action
    return _plan_download_orders(node_id, state, downloading)


def _plan_download_orders(node_id: NodeId, state: State, downloading: frozenset[ModelId]) -> PlannerAction | None:
    """The API's download orders for this node. A model an instance here runs is the
    instance's business: such an order waits (the master refuses new ones)."""
    for model_id, entry in state.download_orders.get(node_id, {}).items():
        if instance_using_files(state, node_id, model_id) is not None:
            continue
        record = state.downloads.get(node_id, {}).get(model_id)
        # A failed or cancelled attempt stays so until a new start order drops its record.
        ended = isinstance(record, DownloadFailed | DownloadCancelled)
        if entry.order == "start" and model_id not in downloading and not ended and not _holds(record, entry.layers):
            # No record (or one the order dropped), files for other layers, or a record
            # left by an earlier run of this node that stopped mid-download.
            return StartModelDownload(model_id, entry.layers)
        if entry.order == "cancel" and download_running(state, node_id, model_id):
            return CancelModelDownload(model_id)
        if entry.order == "delete":
            return DeleteModelFiles(model_id)
    return None


def _holds(record: DownloadProgress | None, layers: tuple[int, int] | None) -> bool:
    """The record is of files covering `layers` (None: the whole model)."""
    if not isinstance(record, DownloadCompleted):
        return False
    return record.layers is None if layers is None else record.covers(*layers)


def _plan_instance(
    node_id: NodeId,
    state: State,
    instance: Instance,
    runner_id: RunnerId,
    runner: LocalRunner | None,
    now: float,
    downloading: frozenset[ModelId],
) -> PlannerAction | None:
    download = state.downloads.get(node_id, {}).get(instance.model_id)
    if isinstance(download, DownloadFailed):
        return DeleteFailedInstance(instance.instance_id, f"model unavailable: {download.error_message}")
    shard = instance.shard_assignments.runner_to_shard[runner_id]
    start, end = layers_needed(instance, node_id) or (0, shard.n_layers)  # None: every layer
    if not isinstance(download, DownloadCompleted) or not download.covers(start, end):
        # No record yet, one left by an earlier run of this node, or files for other
        # layers than this shard's: look (again).
        return None if instance.model_id in downloading else FindModel(instance.instance_id)
    draft_model = instance.draft_model if shard.device_rank == 0 else None
    draft_download = state.downloads.get(node_id, {}).get(draft_model) if draft_model is not None else None
    if isinstance(draft_download, DownloadFailed):
        return DeleteFailedInstance(instance.instance_id, f"draft model unavailable: {draft_download.error_message}")
    if draft_model is not None and not _holds(draft_download, None):
        return None if draft_model in downloading else FindModel(instance.instance_id, draft=True)

    if runner is None:
        # A node restarted while its runner was failing goes on counting from State, so
        # restarting the node never resets the attempts.
        status = state.runners.get(runner_id)
        attempt = status.attempt + 1 if isinstance(status, RunnerFailed) else 1
        return CreateRunner(instance.instance_id, runner_id, attempt=attempt)
    # The master moved a ring port since the runner started: every rank starts again on
    # the new ring, at the attempt it was on. A move neither spends attempts nor resets
    # them, so a failing split instance cannot restart forever by moving.
    moved = runner.hosts != tuple(instance.hosts)
    if runner.exited:
        if runner.failure is not None and RING_BIND_FAILURE in runner.failure:
            # Bound by someone since the worker checked: ask for another port, then start on it.
            if moved:
                return CreateRunner(instance.instance_id, runner_id, attempt=runner.attempt)
            return ReportRingPortTaken(instance.instance_id, runner_id)
        if runner.attempt >= MAX_RUNNER_ATTEMPTS:
            reason = gave_up_reason(instance.model_id, runner.attempt, _last_failure(state, runner))
            return DeleteFailedInstance(instance.instance_id, reason)
        if runner.exited_at is not None and now - runner.exited_at >= RESTART_BACKOFF_SECONDS * runner.attempt:
            return CreateRunner(instance.instance_id, runner_id, attempt=runner.attempt + 1)
        return None
    if moved:
        return CreateRunner(instance.instance_id, runner_id, attempt=runner.attempt)

    abandon = _failed_peer(state, instance, runner_id, runner)
    if abandon is not None:
        return abandon

    own = state.runners.get(runner_id)
    if len(instance.shard_assignments.runner_to_shard) == 1 and runner.status is not None:
        # Alone in its instance, a runner waits for no peer: it steps on its own reports,
        # not on their return through the master, so a node that has just started
        # loads its model while it is still finding the master.
        own = runner.status
    stages = [
        _stage(own if r == runner_id else state.runners.get(r)) for r in instance.shard_assignments.runner_to_shard
    ]
    # Each lifecycle step starts only once every rank has finished the previous one,
    # so ranks move through connect -> load -> warm up together.
    steps: tuple[tuple[LifecycleInstruction, RunnerStatus], ...] = (
        (ConnectToGroup(), RunnerIdle()),
        (LoadModel(model_dir=download.path, draft=_draft_dir(draft_model, draft_download)), RunnerConnected()),
        (StartWarmup(), RunnerLoaded()),
    )
    for instruction, ready_status in steps:
        if type(instruction) not in runner.sent:
            ready_stage = _stage(ready_status)
            if _stage(own) == ready_stage and min(stages) >= ready_stage:
                return RunnerStep(runner_id, instruction)
            return None

    if not isinstance(own, SERVING_STATUSES):
        return None
    if instance.shard_assignments.runner_to_shard[runner_id].device_rank != 0:
        return None  # rank 0 takes the requests and leads the other ranks
    for task in state.tasks.values():
        if task.instance_id != instance.instance_id:
            continue
        if task.status == TaskStatus.Pending and task.task_id not in runner.forwarded:
            return ForwardTask(runner_id, task.task_id)
    # A task the API gave up on (client gone) is deleted from State; stop generating it.
    for task_id in runner.in_flight:
        if task_id not in state.tasks:
            return CancelTask(runner_id, task_id)
    return None


def _draft_dir(model_id: ModelId | None, download: DownloadProgress | None) -> tuple[str, str] | None:
    """(model id, dir) of the draft model rank 0 loads, once its download completed."""
    if model_id is None or not isinstance(download, DownloadCompleted):
        return None
    return model_id, download.path


def _failed_peer(state: State, instance: Instance, runner_id: RunnerId, runner: LocalRunner) -> AbandonRunner | None:
    """A runner in its group whose peer has failed since. The group forms only once no
    rank is failed (ConnectToGroup waits for every rank to be idle), so a failed peer
    seen after that is a new failure, not the one that made this runner restart."""
    if ConnectToGroup not in runner.sent:
        return None
    for peer_id, shard in instance.shard_assignments.runner_to_shard.items():
        status = state.runners.get(peer_id)
        if peer_id != runner_id and isinstance(status, RunnerFailed):
            return AbandonRunner(runner_id, f"rank {shard.device_rank} of the instance failed: {status.error_message}")
    return None


def _last_failure(state: State, runner: LocalRunner) -> str:
    """Why the runner's last run ended: its supervisor's account first, since State gets
    the RunnerFailed only once the master has ordered it, often after the planner looks."""
    if runner.failure is not None:
        return runner.failure
    status = state.runners.get(runner.runner_id)
    return status.error_message if isinstance(status, RunnerFailed) else "runner exited"


def _stage(status: RunnerStatus | None) -> int:
    """How far a runner is along connect -> load -> warm up -> serve."""
    order = (
        (RunnerIdle,),
        (RunnerConnecting,),
        (RunnerConnected,),
        (RunnerLoading,),
        (RunnerLoaded,),
        (RunnerWarmingUp,),
        SERVING_STATUSES,
    )
    for stage, kinds in enumerate(order):
        if isinstance(status, kinds):
            return stage
    return -1
