"""An in-memory ClusterPort for fast in-process API tests.

This is a stand-in, not a cluster: there is no master, worker or runner. State changes
only through the real `apply` with real events, and the "cluster" answers commands the
way the master would in the simplest case: CreateInstance places the instance with every
runner ready at once, DeleteInstance deletes it, a TextGeneration becomes a task and is
answered with the chunks the test scripted. Tests that need a real generation, a real
runner or real networking use a real `exo` process (tests/support/node.py)."""

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from exo.api.port import ApiSettings
from exo.shared.apply import apply
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.commands import (
    AddCustomModelCard,
    Command,
    CreateInstance,
    DeleteInstance,
    TaskFinished,
    TextGeneration,
)
from exo.shared.types.common import CommandId, InstanceId, NodeId, TaskId, new_id
from exo.shared.types.events import (
    CustomModelCardAdded,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    NodeGatheredInfo,
    RunnerStatusUpdated,
    TaskCreated,
    TaskDeleted,
    TaskStatusUpdated,
)
from exo.shared.types.nodes import MemoryInfo, NodeInfo
from exo.shared.types.runners import RunnerReady
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.text_generation import ChunkGenerated

GiB = 2**30


def node_info(node_id: str, available_gib: float = 16) -> NodeInfo:
    return NodeInfo(
        node_id=NodeId(node_id),
        friendly_name=node_id,
        os="Linux",
        backend="cpu",
        cpu_count=2,
        memory=MemoryInfo(total_bytes=int(2 * available_gib * GiB), available_bytes=int(available_gib * GiB)),
        disk_available_bytes=100 * GiB,
        api_port=52415,
    )


class FakeCluster:
    """Implements exo.api.port.ClusterPort over an in-memory State."""

    def __init__(self, cards: Mapping[str, ModelCard], nodes: Sequence[str] = ("node-a",)) -> None:
        self.node_id = NodeId(nodes[0])
        self.session_id = new_id()
        self.settings = ApiSettings()
        self._cards = dict(cards)
        self.state = State()
        self.history: list[IndexedEvent] = []
        self.commands: list[Command] = []
        # What a TextGeneration is answered with; the test sets it.
        self.script: Callable[[CommandId], list[ChunkGenerated]] = lambda _: []
        self._queues: dict[CommandId, asyncio.Queue[ChunkGenerated]] = {}
        self._changed = asyncio.Event()
        for name in nodes:
            self.emit(NodeGatheredInfo(info=node_info(name)))

    def emit(self, event: Event) -> None:
        indexed = IndexedEvent(idx=len(self.history), event=event)
        self.state = apply(self.state, indexed)
        self.history.append(indexed)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, condition: Callable[[State], bool], timeout: float) -> State:
        async with asyncio.timeout(timeout):
            while not condition(self.state):
                await self._changed.wait()
        return self.state

    def send_command(self, command: Command) -> None:
        self.commands.append(command)
        match command:
            case CreateInstance(instance=instance):
                self.emit(InstanceCreated(instance=instance))
                for runner_id in instance.shard_assignments.runner_to_shard:
                    self.emit(RunnerStatusUpdated(runner_id=runner_id, status=RunnerReady()))
            case DeleteInstance(instance_id=instance_id):
                self.emit(InstanceDeleted(instance_id=instance_id, reason="deleted by the test"))
            case AddCustomModelCard(card=card):
                self.emit(CustomModelCardAdded(card=card))
            case TextGeneration():
                self._answer(command)
            case TaskFinished(finished_command_id=command_id):
                for task in list(self.state.tasks.values()):
                    if task.command_id == command_id:
                        self.emit(TaskDeleted(task_id=task.task_id))
            case _:
                pass

    def lose_instance(self, instance_id: InstanceId, replace: bool) -> None:
        """What the master does when a node of the instance leaves: fail its tasks'
        streams (retryable: the cluster's fault), delete it, and re-place the model when
        `replace` (here: the same shards under a new id, ready at once)."""
        instance = self.state.instances[instance_id]
        reason = "node node-b left the cluster"
        for task in list(self.state.tasks.values()):
            if task.instance_id == instance_id:
                message = f"instance {instance_id} was deleted: {reason}"
                self.emit(TaskStatusUpdated(task_id=task.task_id, status=TaskStatus.Failed, error_message=message))
                self.publish_chunk(
                    ChunkGenerated(
                        command_id=task.command_id, finish_reason="error", error_message=message, retryable=True
                    )
                )
        self.emit(InstanceDeleted(instance_id=instance_id, reason=reason))
        if replace:
            self.send_command(
                CreateInstance(instance=instance.model_copy(update={"instance_id": InstanceId(new_id())}))
            )

    def _answer(self, command: TextGeneration) -> None:
        instance = next(i for i in self.state.instances.values() if i.model_id == command.params.model)
        task = TextGenerationTask(
            task_id=TaskId(new_id()),
            command_id=command.command_id,
            instance_id=instance.instance_id,
            origin_session=command.origin_session,
            params=command.params,
        )
        self.emit(TaskCreated(task=task))
        for chunk in self.script(command.command_id):
            self.publish_chunk(chunk)

    def cards(self) -> dict[str, ModelCard]:
        return {**self._cards, **self.state.custom_model_cards}

    def local_model_ids(self) -> set[str]:
        return set()

    def local_model_dir(self, model_id: str) -> Path | None:
        return None

    def model_dir_problem(self, model_id: str) -> str | None:
        return None

    def open_chunks(self, command_id: CommandId) -> asyncio.Queue[ChunkGenerated]:
        queue: asyncio.Queue[ChunkGenerated] = asyncio.Queue()
        self._queues[command_id] = queue
        return queue

    def close_chunks(self, command_id: CommandId) -> None:
        self._queues.pop(command_id, None)

    def chunks_open(self, command_id: CommandId) -> bool:
        return command_id in self._queues

    def publish_chunk(self, chunk: ChunkGenerated) -> None:
        queue = self._queues.get(chunk.command_id)
        if queue is not None:
            queue.put_nowait(chunk)
