"""The worker's planner, walked through a runner's whole life with hand-built States:
find the model, start the runner, connect, load, warm up, serve, and recover or give up."""

from collections.abc import Iterable
from dataclasses import replace

import pytest

from exo.catalog.cards import builtin_cards
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
    DownloadProgress,
)
from exo.shared.types.instances import Instance, ShardAssignments, Sharding
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.shards import PipelineShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.planner import (
    MAX_RUNNER_ATTEMPTS,
    RESTART_BACKOFF_SECONDS,
    AbandonRunner,
    CancelTask,
    CreateRunner,
    DeleteFailedInstance,
    FindModel,
    ForwardTask,
    LocalRunner,
    ReportRingPortTaken,
    RunnerStep,
    ShutdownRunner,
    plan,
)
from exo.worker.runner_protocol import ConnectToGroup, LoadModel, RunnerInstruction, StartWarmup

NODE = NodeId("node-a")
OTHER_NODE = NodeId("node-b")
INSTANCE = InstanceId("inst-1")
RUNNER = RunnerId("runner-a")
OTHER_RUNNER = RunnerId("runner-b")
NOW = 1000.0


@pytest.fixture
def card() -> ModelCard:
    return builtin_cards()["mlx-community/Qwen3.5-2B-MLX-8bit"]


def instance_over(card: ModelCard, nodes_and_runners: list[tuple[NodeId, RunnerId]]) -> Instance:
    world_size = len(nodes_and_runners)
    per_rank = card.n_layers // world_size
    bounds = [rank * per_rank for rank in range(world_size)] + [card.n_layers]
    return Instance(
        instance_id=INSTANCE,
        sharding=Sharding.Pipeline,
        shard_assignments=ShardAssignments(
            model_id=ModelId(card.model_id),
            runner_to_shard={
                runner_id: PipelineShardMetadata(
                    model_card=card,
                    device_rank=rank,
                    world_size=world_size,
                    start_layer=bounds[rank],
                    end_layer=bounds[rank + 1],
                    n_layers=card.n_layers,
                )
                for rank, (_, runner_id) in enumerate(nodes_and_runners)
            },
            node_to_runner=dict(nodes_and_runners),
        ),
    )


def downloaded(
    card: ModelCard, progress: DownloadProgress | None = None
) -> dict[NodeId, dict[ModelId, DownloadProgress]]:
    progress = progress or DownloadCompleted(total_bytes=card.storage_size.in_bytes, path="/models/qwen")
    return {NODE: {ModelId(card.model_id): progress}}


def pending_task(task_id: str = "task-1", status: TaskStatus = TaskStatus.Pending) -> TextGenerationTask:
    return TextGenerationTask(
        task_id=TaskId(task_id),
        command_id=CommandId(f"command-of-{task_id}"),
        instance_id=INSTANCE,
        origin_session="api-session",
        params=TextGenerationTaskParams(
            model=ModelId("mlx-community/Qwen3.5-2B-MLX-8bit"),
            messages=[ChatMessage(role="user", content="Hello")],
        ),
        status=status,
    )


def single_node_state(
    card: ModelCard,
    runner_status: RunnerStatus | None = None,
    tasks: tuple[TextGenerationTask, ...] | list[TextGenerationTask] = (),
    download: DownloadProgress | None = None,
) -> State:
    return State(
        instances={INSTANCE: instance_over(card, [(NODE, RUNNER)])},
        runners={RUNNER: runner_status} if runner_status is not None else {},
        tasks={t.task_id: t for t in tasks},
        downloads=downloaded(card, download),
    )


def local_runner(
    sent: Iterable[type[RunnerInstruction]] = (),
    forwarded: Iterable[str] = (),
    in_flight: Iterable[str] = (),
    runner_id: RunnerId = RUNNER,
    **changes,
) -> dict[RunnerId, LocalRunner]:
    runner = LocalRunner(
        runner_id=runner_id,
        instance_id=INSTANCE,
        sent=frozenset(sent),
        forwarded=frozenset(TaskId(t) for t in forwarded),
        in_flight=frozenset(TaskId(t) for t in in_flight),
        exited=False,
        exited_at=None,
        attempt=1,
    )
    return {runner_id: replace(runner, **changes)}


ALL_STEPS = {ConnectToGroup, LoadModel, StartWarmup}
LOAD_MODEL = LoadModel(model_dir="/models/qwen")  # where downloaded() finds the model


# --- model -----------------------------------------------------------------------------


def test_find_model_when_there_is_no_download_record(card: ModelCard):
    state = single_node_state(card).model_copy(update={"downloads": {}})
    assert plan(NODE, state, {}, NOW) == FindModel(INSTANCE)


def test_wait_while_this_worker_downloads_the_model(card: ModelCard):
    state = single_node_state(card, download=DownloadOngoing(downloaded_bytes=1, total_bytes=10))
    assert plan(NODE, state, {}, NOW, downloading=frozenset({card.model_id})) is None


def test_look_again_for_a_download_an_earlier_run_left_unfinished(card: ModelCard):
    state = single_node_state(card, download=DownloadOngoing(downloaded_bytes=1, total_bytes=10))
    assert plan(NODE, state, {}, NOW) == FindModel(INSTANCE)


def test_delete_instance_when_the_download_failed(card: ModelCard):
    state = single_node_state(card, download=DownloadFailed(error_message="repository not found"))
    action = plan(NODE, state, {}, NOW)
    assert isinstance(action, DeleteFailedInstance)
    assert action.instance_id == INSTANCE
    assert "repository not found" in action.reason


def test_nothing_for_an_instance_without_a_runner_on_this_node(card: ModelCard):
    state = single_node_state(card)
    assert plan(OTHER_NODE, state, {}, NOW) is None


# --- start and lifecycle steps -----------------------------------------------------------


def test_create_runner_once_the_model_is_found_and_no_local_runner_exists(
    card: ModelCard,
):
    assert plan(NODE, single_node_state(card), {}, NOW) == CreateRunner(INSTANCE, RUNNER, attempt=1)


def test_nothing_until_the_new_runner_reports_its_status(card: ModelCard):
    assert plan(NODE, single_node_state(card), local_runner(), NOW) is None


def test_connect_to_group_when_the_runner_is_idle(card: ModelCard):
    state = single_node_state(card, RunnerIdle())
    assert plan(NODE, state, local_runner(), NOW) == RunnerStep(RUNNER, ConnectToGroup())


def test_nothing_while_waiting_for_a_step_already_sent(card: ModelCard):
    state = single_node_state(card, RunnerConnecting())
    assert plan(NODE, state, local_runner(sent={ConnectToGroup}), NOW) is None


def test_nothing_while_the_status_still_shows_the_previous_stage(card: ModelCard):
    # The step was sent but the runner's status update has not arrived yet.
    state = single_node_state(card, RunnerIdle())
    assert plan(NODE, state, local_runner(sent={ConnectToGroup}), NOW) is None


def test_load_model_once_connected(card: ModelCard):
    state = single_node_state(card, RunnerConnected())
    assert plan(NODE, state, local_runner(sent={ConnectToGroup}), NOW) == RunnerStep(RUNNER, LOAD_MODEL)


def test_start_warmup_once_loaded(card: ModelCard):
    state = single_node_state(card, RunnerLoaded())
    local = local_runner(sent={ConnectToGroup, LoadModel})
    assert plan(NODE, state, local, NOW) == RunnerStep(RUNNER, StartWarmup())


def test_a_runner_alone_in_its_instance_steps_on_its_own_reports_before_state_has_them(card: ModelCard):
    """A node restarted on its old history holds its runner's last status from before
    (Ready) and no master yet to order the new ones: the runner loads meanwhile."""
    state = single_node_state(card, RunnerReady())
    assert plan(NODE, state, local_runner(), NOW) is None  # the process has not reported yet
    assert plan(NODE, state, local_runner(status=RunnerIdle()), NOW) == RunnerStep(RUNNER, ConnectToGroup())
    local = local_runner(sent={ConnectToGroup}, status=RunnerConnected())
    assert plan(NODE, state, local, NOW) == RunnerStep(RUNNER, LOAD_MODEL)
    local = local_runner(sent={ConnectToGroup, LoadModel}, status=RunnerLoaded())
    assert plan(NODE, state, local, NOW) == RunnerStep(RUNNER, StartWarmup())
    local = local_runner(sent=ALL_STEPS, status=RunnerWarmingUp())
    tasks = single_node_state(card, RunnerReady(), tasks=[pending_task()])
    assert plan(NODE, tasks, local, NOW) is None
    local = local_runner(sent=ALL_STEPS, status=RunnerReady())
    assert plan(NODE, tasks, local, NOW) == ForwardTask(RUNNER, TaskId("task-1"))


# --- serving -------------------------------------------------------------------------------


def test_forward_a_pending_task_once_ready(card: ModelCard):
    state = single_node_state(card, RunnerReady(), tasks=[pending_task()])
    assert plan(NODE, state, local_runner(sent=ALL_STEPS), NOW) == ForwardTask(RUNNER, TaskId("task-1"))


def test_no_task_forwarded_before_the_runner_is_ready(card: ModelCard):
    state = single_node_state(card, RunnerLoaded(), tasks=[pending_task()])
    assert plan(NODE, state, local_runner(sent=ALL_STEPS), NOW) is None


def test_a_forwarded_task_is_not_forwarded_again(card: ModelCard):
    state = single_node_state(card, RunnerRunning(), tasks=[pending_task()])
    local = local_runner(sent=ALL_STEPS, forwarded={"task-1"}, in_flight={"task-1"})
    assert plan(NODE, state, local, NOW) is None


def test_a_running_runner_takes_the_next_pending_task(card: ModelCard):
    state = single_node_state(
        card,
        RunnerRunning(),
        tasks=[pending_task("task-1", TaskStatus.Running), pending_task("task-2")],
    )
    local = local_runner(sent=ALL_STEPS, forwarded={"task-1"}, in_flight={"task-1"})
    assert plan(NODE, state, local, NOW) == ForwardTask(RUNNER, TaskId("task-2"))


def test_cancel_an_in_flight_task_that_vanished_from_state(card: ModelCard):
    state = single_node_state(card, RunnerRunning())
    local = local_runner(sent=ALL_STEPS, forwarded={"task-1"}, in_flight={"task-1"})
    assert plan(NODE, state, local, NOW) == CancelTask(RUNNER, TaskId("task-1"))


# --- teardown and recovery -------------------------------------------------------------------


def test_shutdown_a_local_runner_whose_instance_is_gone(card: ModelCard):
    state = single_node_state(card).model_copy(update={"instances": {}})
    assert plan(NODE, state, local_runner(sent=ALL_STEPS), NOW) == ShutdownRunner(RUNNER)


def test_no_shutdown_for_a_runner_that_already_exited(card: ModelCard):
    state = single_node_state(card).model_copy(update={"instances": {}})
    assert plan(NODE, state, local_runner(exited=True, exited_at=NOW), NOW) is None


def test_no_restart_before_the_backoff_elapsed(card: ModelCard):
    state = single_node_state(card, RunnerFailed(error_message="segfault"))
    local = local_runner(exited=True, exited_at=NOW, attempt=1)
    assert plan(NODE, state, local, NOW + RESTART_BACKOFF_SECONDS - 0.1) is None


def test_restart_with_the_next_attempt_once_the_backoff_elapsed(card: ModelCard):
    state = single_node_state(card, RunnerFailed(error_message="segfault"))
    local = local_runner(exited=True, exited_at=NOW, attempt=1)
    assert plan(NODE, state, local, NOW + RESTART_BACKOFF_SECONDS) == CreateRunner(INSTANCE, RUNNER, attempt=2)


def test_backoff_grows_with_the_attempt(card: ModelCard):
    state = single_node_state(card, RunnerFailed(error_message="segfault", attempt=2))
    local = local_runner(exited=True, exited_at=NOW, attempt=2)
    assert plan(NODE, state, local, NOW + RESTART_BACKOFF_SECONDS * 2 - 0.1) is None
    assert plan(NODE, state, local, NOW + RESTART_BACKOFF_SECONDS * 2) == CreateRunner(INSTANCE, RUNNER, attempt=3)


OLD_RING = ("127.0.0.1:31000", "127.0.0.1:31001")
NEW_RING = ["127.0.0.1:31005", "127.0.0.1:31001"]


def moved_ring(state: State) -> State:
    """`state` after the master moved rank 0's port (taken on its node)."""
    moved = state.instances[INSTANCE].model_copy(update={"hosts": NEW_RING})
    return state.model_copy(update={"instances": {INSTANCE: moved}})


def test_a_runner_started_on_ring_addresses_the_instance_no_longer_has_is_restarted_at_its_attempt(card: ModelCard):
    # Every rank restarts on the new ring; the move spends no attempt and resets none.
    state = moved_ring(single_node_state(card, RunnerIdle()))
    local = local_runner(hosts=OLD_RING, attempt=2)
    assert plan(NODE, state, local, NOW) == CreateRunner(INSTANCE, RUNNER, attempt=2)
    assert plan(NODE, state, local_runner(hosts=tuple(NEW_RING)), NOW) == RunnerStep(RUNNER, ConnectToGroup())


def test_a_failed_runner_whose_ring_moved_keeps_its_backoff_and_its_count(card: ModelCard):
    """The other rank's port was taken when it restarted: this rank, failed twice
    already, does not start over at attempt 1 (a split instance failing the same way would
    otherwise restart for as long as ports move)."""
    state = moved_ring(single_node_state(card, RunnerFailed(error_message="RuntimeError: no stream", attempt=2)))
    local = local_runner(hosts=OLD_RING, exited=True, exited_at=NOW, attempt=2, failure="RuntimeError: no stream")
    assert plan(NODE, state, local, NOW + 1) is None
    assert plan(NODE, state, local, NOW + RESTART_BACKOFF_SECONDS * 2) == CreateRunner(INSTANCE, RUNNER, attempt=3)
    last = local_runner(hosts=OLD_RING, exited=True, exited_at=NOW, attempt=3, failure="RuntimeError: no stream")
    action = plan(NODE, state, last, NOW)
    assert isinstance(action, DeleteFailedInstance) and "RuntimeError: no stream" in action.reason


def test_a_ring_bind_failure_asks_for_another_port_instead_of_counting_an_attempt(card: ModelCard):
    failure = "RuntimeError: [ring] Couldn't bind socket (error: 98)"
    state = single_node_state(card, RunnerFailed(error_message=failure, attempt=MAX_RUNNER_ATTEMPTS))
    local = local_runner(exited=True, exited_at=NOW, attempt=MAX_RUNNER_ATTEMPTS, failure=failure, hosts=OLD_RING)
    state = state.model_copy(
        update={"instances": {INSTANCE: state.instances[INSTANCE].model_copy(update={"hosts": list(OLD_RING)})}}
    )
    assert plan(NODE, state, local, NOW) == ReportRingPortTaken(INSTANCE, RUNNER)
    # Once moved, it starts on the new port at once, at the same attempt.
    assert plan(NODE, moved_ring(state), local, NOW) == CreateRunner(INSTANCE, RUNNER, attempt=MAX_RUNNER_ATTEMPTS)


def test_a_node_restarted_while_its_runner_was_failing_goes_on_counting(card: ModelCard):
    state = single_node_state(card, RunnerFailed(error_message="RuntimeError: no stream", attempt=2))
    assert plan(NODE, state, {}, NOW) == CreateRunner(INSTANCE, RUNNER, attempt=3)


def test_the_reason_given_up_with_is_the_runners_own_error_before_state_has_it(card: ModelCard):
    # The worker's report of the last failure goes round the master: State still shows
    # the previous attempt's status when the planner gives up.
    state = single_node_state(card, RunnerLoading())
    failure = "RuntimeError: There is no Stream(cpu, 2) in current thread"
    local = local_runner(exited=True, exited_at=NOW, attempt=MAX_RUNNER_ATTEMPTS, failure=failure)
    action = plan(NODE, state, local, NOW)
    assert isinstance(action, DeleteFailedInstance) and action.reason.endswith(f"last: {failure}")


def test_delete_instance_after_max_runner_attempts(card: ModelCard):
    state = single_node_state(card, RunnerFailed(error_message="out of memory", attempt=MAX_RUNNER_ATTEMPTS))
    local = local_runner(exited=True, exited_at=NOW, attempt=MAX_RUNNER_ATTEMPTS)
    action = plan(NODE, state, local, NOW + 3600)
    assert isinstance(action, DeleteFailedInstance)
    assert action.instance_id == INSTANCE
    assert "out of memory" in action.reason
    assert f"{MAX_RUNNER_ATTEMPTS} times" in action.reason


# --- two ranks -------------------------------------------------------------------------------


def two_rank_state(card: ModelCard, own: RunnerStatus, other: RunnerStatus | None) -> State:
    runners = {RUNNER: own} | ({OTHER_RUNNER: other} if other is not None else {})
    return State(
        instances={INSTANCE: instance_over(card, [(NODE, RUNNER), (OTHER_NODE, OTHER_RUNNER)])},
        runners=runners,
        downloads=downloaded(card),
    )


def test_rank_0_does_not_connect_before_the_other_rank_has_started(card: ModelCard):
    state = two_rank_state(card, own=RunnerIdle(), other=None)
    assert plan(NODE, state, local_runner(), NOW) is None


def test_rank_0_does_not_load_until_the_other_rank_is_connected(card: ModelCard):
    state = two_rank_state(card, own=RunnerConnected(), other=RunnerConnecting())
    assert plan(NODE, state, local_runner(sent={ConnectToGroup}), NOW) is None


def test_a_rank_of_a_split_steps_on_state_not_on_its_own_reports(card: ModelCard):
    """Its peers see its status only through the master: it moves when they can."""
    state = two_rank_state(card, own=RunnerConnecting(), other=RunnerConnected())
    local = local_runner(sent={ConnectToGroup}, status=RunnerConnected())
    assert plan(NODE, state, local, NOW) is None


def test_rank_0_loads_once_every_rank_is_connected(card: ModelCard):
    state = two_rank_state(card, own=RunnerConnected(), other=RunnerConnected())
    assert plan(NODE, state, local_runner(sent={ConnectToGroup}), NOW) == RunnerStep(RUNNER, LOAD_MODEL)


def test_a_runner_whose_peer_failed_mid_stream_is_abandoned(card: ModelCard):
    """Rank 1's runner died while rank 0 was serving: rank 0 may be blocked in the ring
    waiting on it, so it is killed (failing its streams) rather than left to hang."""
    state = two_rank_state(card, own=RunnerRunning(), other=RunnerFailed(error_message="exit code -9"))
    action = plan(NODE, state, local_runner(sent=ALL_STEPS, in_flight={"task-1"}), NOW)
    assert isinstance(action, AbandonRunner) and action.runner_id == RUNNER
    assert "rank 1" in action.reason and "exit code -9" in action.reason


def test_a_restarted_runner_waits_for_its_failed_peer_instead_of_abandoning(card: ModelCard):
    """After a restart the new runner is not in a group yet: the peer's old failure is
    what it waits out, not a reason to stop again."""
    state = two_rank_state(card, own=RunnerIdle(), other=RunnerFailed(error_message="exit code -9"))
    assert plan(NODE, state, local_runner(attempt=2), NOW) is None


# --- a split instance that fails the same way on every rank ------------------------------------


NO_STREAM = "RuntimeError: There is no Stream(cpu, 2) in current thread"


def run_two_ranks_failing_at_load(card: ModelCard, ring_moves_on_restart: bool, steps: int = 400) -> tuple[str, int]:
    """Both ranks' workers planning over one State, each rank's load failing with the
    same error every time; with `ring_moves_on_restart`, each restart first finds its
    port taken (a crashed runner still holding it), and the master moves it. Returns why
    the instance was deleted ("" if it never was) and the highest attempt started."""
    instance = instance_over(card, [(NODE, RUNNER), (OTHER_NODE, OTHER_RUNNER)])
    instance = instance.model_copy(update={"hosts": ["10.0.0.1:31000", "10.0.0.2:31001"]})
    model = ModelId(card.model_id)
    done = DownloadCompleted(total_bytes=1, path="/models/qwen")
    state = State(instances={INSTANCE: instance}, downloads={NODE: {model: done}, OTHER_NODE: {model: done}})
    local: dict[NodeId, dict[RunnerId, LocalRunner]] = {NODE: {}, OTHER_NODE: {}}
    exits = {RUNNER: 0, OTHER_RUNNER: 0}
    moved_for: set[tuple[RunnerId, int]] = set()  # (runner, exits): once per restart
    highest = 0

    def set_status(runner_id: RunnerId, status: RunnerStatus) -> None:
        nonlocal state
        state = state.model_copy(update={"runners": {**state.runners, runner_id: status}})

    def exit_runner(node_id: NodeId, runner: LocalRunner, failure: str, now: float) -> None:
        local[node_id][runner.runner_id] = replace(runner, exited=True, exited_at=now, failure=failure)
        exits[runner.runner_id] += 1
        set_status(runner.runner_id, RunnerFailed(error_message=failure, attempt=runner.attempt))

    for step in range(steps):
        now = NOW + step * 0.5
        for node_id in (NODE, OTHER_NODE):
            action = plan(node_id, state, local[node_id], now)
            match action:
                case CreateRunner(runner_id=runner_id, attempt=attempt):
                    rank = instance.shard_assignments.runner_to_shard[runner_id].device_rank
                    if ring_moves_on_restart and exits[runner_id] and (runner_id, exits[runner_id]) not in moved_for:
                        moved_for.add((runner_id, exits[runner_id]))
                        hosts = list(state.instances[INSTANCE].hosts)
                        hosts[rank] = f"{hosts[rank].rsplit(':', 1)[0]}:{31002 + len(moved_for)}"
                        moved = state.instances[INSTANCE].model_copy(update={"hosts": hosts})
                        state = state.model_copy(update={"instances": {INSTANCE: moved}})
                        continue
                    highest = max(highest, attempt)
                    hosts = tuple(state.instances[INSTANCE].hosts)
                    local[node_id][runner_id] = replace(
                        local_runner(runner_id=runner_id)[runner_id], attempt=attempt, hosts=hosts
                    )
                    set_status(runner_id, RunnerIdle())
                case RunnerStep(runner_id=runner_id, instruction=ConnectToGroup()):
                    runner = local[node_id][runner_id]
                    local[node_id][runner_id] = replace(runner, sent=runner.sent | {ConnectToGroup})
                    set_status(runner_id, RunnerConnected())
                case RunnerStep(runner_id=runner_id, instruction=LoadModel()):
                    exit_runner(node_id, local[node_id][runner_id], NO_STREAM, now)
                case AbandonRunner(runner_id=runner_id, reason=reason):
                    exit_runner(node_id, local[node_id][runner_id], reason, now)
                case ShutdownRunner(runner_id=runner_id):
                    del local[node_id][runner_id]
                case DeleteFailedInstance(reason=reason):
                    return reason, highest
                case None:
                    pass
                case _:
                    raise AssertionError(f"unexpected {action}")
    return "", highest


@pytest.mark.parametrize("ring_moves_on_restart", [False, True])
def test_a_split_instance_failing_the_same_way_on_every_rank_is_given_up_on(
    card: ModelCard, ring_moves_on_restart: bool
):
    reason, highest = run_two_ranks_failing_at_load(card, ring_moves_on_restart)
    assert reason == f"the runner of {card.model_id} failed {MAX_RUNNER_ATTEMPTS} times, last: {NO_STREAM}"
    assert highest == MAX_RUNNER_ATTEMPTS
