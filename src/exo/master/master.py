"""The master: the single writer of the cluster's history. It turns commands and the
workers' local events into indexed events, logs them durably, and broadcasts them."""

import asyncio
from collections.abc import Callable

from loguru import logger

from exo.master.placement import (
    PlacementError,
    instance_problem,
    place_instance,
    splits_to_move_to_mlx,
    with_free_ring_ports,
    with_ring_port_moved,
)
from exo.routing.replica import StateReplica
from exo.routing.router import Router, Topic
from exo.shared.queries import download_running, has_task_for, instance_using_files, least_loaded_instance
from exo.shared.types.commands import (
    AddCustomModelCard,
    CancelDownload,
    Command,
    CreateInstance,
    DeleteCustomModelCard,
    DeleteDownload,
    DeleteInstance,
    MoveRingPort,
    RequestEventLog,
    StartDownload,
    TaskFinished,
    TextGeneration,
)
from exo.shared.types.common import (
    CommandId,
    InstanceId,
    ModelId,
    NodeId,
    TaskId,
    new_id,
)
from exo.shared.types.downloads import DownloadOrder
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
    NodeTimedOut,
    TaskCreated,
    TaskDeleted,
    TaskStatusUpdated,
)
from exo.shared.types.instances import Instance
from exo.shared.types.state import State, StateDigest, StateSnapshot, state_digest
from exo.shared.types.tasks import (
    FINISHED_TASK_STATUSES,
    TaskStatus,
    TextGenerationTask,
)
from exo.shared.types.text_generation import ChunkGenerated

# How often the master looks for nodes that stopped sending heartbeats.
NODE_CHECK_SECONDS = 1.0
# An instance whose ring ports were found taken this many times is given up on: something
# on its nodes binds whatever port it is given.
MAX_RING_PORT_MOVES = 16


class Master:
    """Runs only on the elected node. Its State is this node's replica, which it writes
    first (durably) and then broadcasts, so a successor continues the same history."""

    def __init__(
        self,
        node_id: NodeId,
        router: Router,
        replica: StateReplica,
        alive_nodes: Callable[[], set[NodeId]],
        alive_sessions: Callable[[], set[str]],
    ) -> None:
        self.node_id = node_id
        self.router = router
        self.replica = replica
        self.alive_nodes = alive_nodes
        self.alive_sessions = alive_sessions
        # Ring ports some node found bound by another program: never handed out again.
        self._taken_ring_ports: set[int] = set()
        self._ring_moves: dict[InstanceId, int] = {}
        self._commands = router.subscribe(Topic.COMMANDS)
        self._local_events = router.subscribe(Topic.LOCAL_EVENTS)

    @property
    def state(self) -> State:
        return self.replica.state

    async def run(self) -> None:
        try:
            self._take_office()
            await asyncio.gather(self._consume_commands(), self._consume_local_events(), self._housekeeping())
        finally:
            self.router.unsubscribe(Topic.COMMANDS, self._commands)
            self.router.unsubscribe(Topic.LOCAL_EVENTS, self._local_events)

    def _take_office(self) -> None:
        self.emit(MasterElected(node_id=self.node_id))
        # An election often follows a node's death (the old master's): act on it now,
        # so streams it served end and its instances are re-placed without a delay.
        self._drop_lost_nodes()
        self._drop_orphaned_tasks()
        self._move_splits_to_mlx()

    def _drop_lost_nodes(self) -> None:
        alive = self.alive_nodes()
        for node_id in [n for n in self.state.nodes if n not in alive]:
            self.node_left(node_id)

    def _drop_orphaned_tasks(self) -> None:
        """Tasks whose client stream is gone: asked through a node process that left
        or restarted. Deleting them also stops their generation."""
        alive = self.alive_sessions()
        for task in list(self.state.tasks.values()):
            if task.origin_session not in alive:
                self.emit(TaskDeleted(task_id=task.task_id))

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(NODE_CHECK_SECONDS)
            # Re-announce the head of the log, so a node that joined a quiet cluster
            # notices it is behind and asks for the rest.
            if (head := self.replica.head()) is not None:
                self.router.publish(Topic.GLOBAL_EVENTS, head)
            # And its State's digest there, which a node that wrote apart cannot match.
            digest = StateDigest(idx=self.state.last_event_applied_idx, digest=state_digest(self.state))
            self.router.publish(Topic.GLOBAL_EVENTS, digest)
            self._drop_lost_nodes()
            self._drop_orphaned_tasks()

    def node_left(self, node_id: NodeId) -> None:
        lost = [i for i in self.state.instances.values() if node_id in i.shard_assignments.node_to_runner]
        for instance in lost:
            self._delete_instance(instance.instance_id, f"node {node_id} left the cluster")
        self.emit(NodeTimedOut(node_id=node_id))
        for instance in lost:
            if instance.prefill_for is None:  # one that only prefilled for another goes with its node
                self._replace(instance)

    def _replace(self, lost: Instance) -> None:
        """Put a model that lost a node back on the nodes that remain, if it fits."""
        card = next(iter(lost.shard_assignments.runner_to_shard.values())).model_card
        try:
            instance = place_instance(self.state, card, lost.sharding)
        except PlacementError as error:
            logger.warning(f"cannot re-place {card.model_id} after losing a node: {error}")
            return
        logger.info(f"re-placing {card.model_id} on {list(instance.shard_assignments.node_to_runner)}")
        self.emit(InstanceCreated(instance=instance))

    def _move_splits_to_mlx(self) -> None:
        """Splits on llama.cpp that must run MLX now (a node reported that llama.cpp refused
        the model) go on MLX at once, on the same nodes: their runners could only fail,
        and be given up on at the third failure."""
        for old, new in splits_to_move_to_mlx(self.state):
            reason = f"placed again as instance {new.instance_id} on MLX ({new.engine_reason})"
            logger.warning(f"instance {old.instance_id} of {old.model_id}: {reason}")
            # The new one first: a request waiting for the old one then always finds it.
            self.emit(InstanceCreated(instance=new))
            self._delete_instance(old.instance_id, reason)

    async def _consume_commands(self) -> None:
        while True:
            command = await self._commands.get()
            try:
                self.handle_command(command)
                self._move_splits_to_mlx()  # a split placed on llama.cpp by hand
            except Exception:
                logger.exception(f"master: command {command.kind} failed")

    async def _consume_local_events(self) -> None:
        while True:
            self.emit(await self._local_events.get())
            try:
                self._move_splits_to_mlx()  # a node's report of a refusal
            except Exception:
                logger.exception("master: moving splits to MLX failed")

    def emit(self, event: Event) -> None:
        indexed = IndexedEvent(idx=self.state.last_event_applied_idx + 1, event=event)
        self.replica.append(indexed)
        self.router.publish(Topic.GLOBAL_EVENTS, indexed)

    def handle_command(self, command: Command) -> None:
        match command:
            case CreateInstance(instance=instance) if instance.instance_id not in self.state.instances:
                # The API checked it against its node's State; the master's may be newer.
                if (problem := instance_problem(self.state, instance)) is not None:
                    logger.warning(f"not creating instance {instance.instance_id}: {problem}")
                else:
                    self.emit(InstanceCreated(instance=with_free_ring_ports(self.state, instance)))
            case DeleteInstance(instance_id=instance_id, reason=reason):
                self._delete_instance(instance_id, reason)
            case TextGeneration(command_id=command_id, params=params):
                self._start_text_generation(command_id, params.model, command)
            case AddCustomModelCard(card=card):
                # The same card again (asked for again after a partition) changes nothing.
                if self.state.custom_model_cards.get(ModelId(card.model_id)) != card:
                    self.emit(CustomModelCardAdded(card=card))
            case DeleteCustomModelCard(model_id=model_id):
                if model_id in self.state.custom_model_cards:
                    self.emit(CustomModelCardDeleted(model_id=model_id))
            case StartDownload() | CancelDownload() | DeleteDownload():
                self._order_download(command)
            case MoveRingPort(instance_id=instance_id, node_id=node_id, host=host):
                self._move_ring_port(instance_id, node_id, host)
            case RequestEventLog(since_idx=since_idx):
                if since_idx < self.replica.history.start:
                    # Compacted away (or -1: a node starting over): it takes the whole State.
                    self.router.publish(Topic.GLOBAL_EVENTS, StateSnapshot(snapshot=self.state))
                    return
                for indexed in self.replica.history.since(since_idx):
                    self.router.publish(Topic.GLOBAL_EVENTS, indexed)
            case TaskFinished(finished_command_id=finished_command_id):
                for task in list(self.state.tasks.values()):
                    if task.command_id == finished_command_id:
                        self.emit(TaskDeleted(task_id=task.task_id))

    def _move_ring_port(self, instance_id: InstanceId, node_id: NodeId, host: str) -> None:
        instance = self.state.instances.get(instance_id)
        if instance is None or host not in instance.hosts:
            return  # already moved (the worker asks again until it sees the change)
        if len(self._taken_ring_ports) > MAX_RING_PORT_MOVES * 8:
            self._taken_ring_ports.clear()  # held long ago; most are free again
        self._taken_ring_ports.add(int(host.rsplit(":", 1)[1]))
        moves = self._ring_moves[instance_id] = self._ring_moves.get(instance_id, 0) + 1
        reason = f"ring port {host} is taken on node {node_id}"
        if moves > MAX_RING_PORT_MOVES:
            self._delete_instance(instance_id, f"{reason}, after {MAX_RING_PORT_MOVES} other ports were too")
            return
        moved = with_ring_port_moved(self.state, instance, host, self._taken_ring_ports)
        logger.warning(f"{reason}: instance {instance_id} moves to {moved.hosts}")
        self.emit(InstanceRingMoved(instance_id=instance_id, hosts=moved.hosts, reason=reason))

    def _order_download(self, command: StartDownload | CancelDownload | DeleteDownload) -> None:
        """The API checked the command against its node's State; the master's may be newer."""
        node_id, model_id = command.node_id, command.model_id
        problem = None
        if node_id not in self.state.nodes:
            problem = f"node {node_id} is not in the cluster"
        elif not isinstance(command, StartDownload) and instance_using_files(self.state, node_id, model_id):
            problem = f"an instance on node {node_id} uses {model_id}"
        elif isinstance(command, CancelDownload) and not download_running(self.state, node_id, model_id):
            problem = f"no download of {model_id} is running on node {node_id}"
        if problem is not None:
            logger.warning(f"not carrying out {command.kind}: {problem}")
            return
        order: DownloadOrder
        match command:
            case StartDownload():
                order = "start"
            case CancelDownload():
                order = "cancel"
            case DeleteDownload():
                order = "delete"
        layers = command.layers if isinstance(command, StartDownload) else None
        self.emit(DownloadOrdered(node_id=node_id, model_id=model_id, order=order, layers=layers))

    def _delete_instance(self, instance_id: InstanceId, reason: str) -> None:
        if instance_id not in self.state.instances:
            return
        for task in list(self.state.tasks.values()):
            if task.instance_id == instance_id and task.status not in FINISHED_TASK_STATUSES:
                message = f"instance {instance_id} was deleted: {reason}"
                self.emit(TaskStatusUpdated(task_id=task.task_id, status=TaskStatus.Failed, error_message=message))
                self._fail_stream(task.command_id, message)
        self.emit(InstanceDeleted(instance_id=instance_id, reason=reason))
        for other in list(self.state.instances.values()):
            if other.prefill_for is not None and other.prefill_for.instance_id == instance_id:
                self._delete_instance(other.instance_id, f"it prefilled for instance {instance_id}, deleted: {reason}")

    def _start_text_generation(self, command_id: CommandId, model_id: ModelId, command: TextGeneration) -> None:
        if has_task_for(self.state, command_id):
            return  # the API sends a command again when it was not accepted in time
        instance_id = least_loaded_instance(self.state, model_id)
        if instance_id is None:
            self._fail_stream(command_id, f"no running instance serves model '{model_id}'")
            return
        task = TextGenerationTask(
            task_id=TaskId(new_id()),
            command_id=command_id,
            instance_id=instance_id,
            origin_session=command.origin_session,
            params=command.params,
        )
        self.emit(TaskCreated(task=task))

    def _fail_stream(self, command_id: CommandId, message: str) -> None:
        self.router.publish(
            Topic.CHUNKS,
            ChunkGenerated(command_id=command_id, finish_reason="error", error_message=message, retryable=True),
        )
