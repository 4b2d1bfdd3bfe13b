"""One supervisor per runner subprocess: starts it, relays its messages, and turns a
crash into RunnerFailed plus a clear error on every stream it was serving."""

import asyncio
import multiprocessing as mp
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from loguru import logger

from exo.shared.types.common import CommandId, RunnerId, TaskId
from exo.shared.types.events import Event, RunnerStatusUpdated, TaskStatusUpdated
from exo.shared.types.instances import EngineKind, Instance
from exo.shared.types.runners import RunnerFailed, RunnerShutdown, RunnerStatus
from exo.shared.types.tasks import FINISHED_TASK_STATUSES, TaskStatus
from exo.shared.types.text_generation import ChunkGenerated
from exo.worker.chunk_coalescing import coalesced
from exo.worker.runner import runner_main, spare_main
from exo.worker.runner_protocol import (
    BecomeRunner,
    CancelRunnerTask,
    RunnerInstruction,
    Shutdown,
    SubmitTask,
)

# Messages read from the pipe at once (and merged where they can be) before relaying.
MAX_READ = 64


def _runners_file(exo_home: Path) -> Path:
    return exo_home / "data" / "runners"


def record_runners(exo_home: Path, runner_ids: Iterable[RunnerId]) -> None:
    """The runners this node's worker runs, each time they change (not when the node
    stops): a node that stopped with some starts a spare runner process as it starts
    again (`ran_runners`)."""
    path = _runners_file(exo_home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{runner_id}\n" for runner_id in runner_ids))


def ran_runners(exo_home: Path) -> bool:
    try:
        return bool(_runners_file(exo_home).read_text().strip())
    except OSError:
        return False


class SpareRunner:
    """A runner process started with the node, before the worker knows what it will run:
    it imports the engine (most of a runner's start) while the node loads its history
    and joins the cluster, so a restarted node's runner is ready sooner. The first
    runner the worker creates takes it (`RunnerSupervisor(spare=...)`). Started only
    where the node ran runners when it stopped (`ran_runners`): elsewhere it would
    cost a second of CPU and its memory for nothing."""

    def __init__(self, engine: EngineKind, verbose: bool) -> None:
        context = mp.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=spare_main, args=(child_conn, engine, verbose), name="exo-runner-spare", daemon=True
        )
        self.process.start()
        child_conn.close()

    def close(self) -> None:
        """Unused: the process exits when its pipe closes."""
        self.conn.close()


class RunnerSupervisor:
    def __init__(
        self,
        runner_id: RunnerId,
        instance: Instance,
        on_event: Callable[[Event], None],
        on_chunk: Callable[[ChunkGenerated], None],
        verbose: bool = False,
        attempt: int = 1,
        spare: SpareRunner | None = None,
    ) -> None:
        self.runner_id = runner_id
        self.instance = instance
        self.on_event = on_event
        self.on_chunk = on_chunk
        self.attempt = attempt
        # Instructions already sent, so the planner never repeats a lifecycle step.
        self.sent: set[type[RunnerInstruction]] = set()
        self.in_flight: dict[TaskId, CommandId] = {}
        self.exited = False
        # Told to stop: however it then exits (killed while still starting, say), that
        # is a shutdown, not a failure.
        self.stopping = False
        self.failure_message: str | None = None
        # The last status the process reported.
        self.status: RunnerStatus | None = None
        if spare is not None and spare.process.is_alive():
            self._conn, self.process = spare.conn, spare.process
            self._conn.send(BecomeRunner(runner_id=runner_id, instance=instance))
        else:
            context = mp.get_context("spawn")
            self._conn, child_conn = context.Pipe()
            self.process = context.Process(
                target=runner_main,
                args=(child_conn, runner_id, instance, verbose),
                name=f"exo-runner-{runner_id[:8]}",
                daemon=True,
            )
            self.process.start()
            child_conn.close()
        loop = asyncio.get_running_loop()
        loop.add_reader(self._conn.fileno(), self._on_readable)

    def send(self, instruction: RunnerInstruction) -> None:
        if self.exited:
            return
        self.sent.add(type(instruction))
        if isinstance(instruction, SubmitTask):
            self.in_flight[instruction.task.task_id] = instruction.task.command_id
        try:
            self._conn.send(instruction)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._on_exit()

    def cancel(self, task_id: TaskId) -> None:
        # No longer in flight from here on, so the planner asks only once.
        self.in_flight.pop(task_id, None)
        self.send(CancelRunnerTask(task_id=task_id))

    def _on_readable(self) -> None:
        arrived: list[Any] = []
        gone = False
        try:
            while self._conn.poll() and len(arrived) < MAX_READ:
                arrived.append(self._conn.recv())
        except (EOFError, OSError):
            gone = True
        for message in coalesced(arrived):
            self._relay(message)
        if gone:
            self._on_exit()

    def _relay(self, message: Any) -> None:
        if isinstance(message, ChunkGenerated):
            self.on_chunk(message)
            return
        if isinstance(message, RunnerStatusUpdated) and isinstance(message.status, RunnerFailed):
            # The runner's own account of its failure beats "exited with code 1".
            self.failure_message = message.status.error_message
            return
        if isinstance(message, RunnerStatusUpdated):
            self.status = message.status
        if isinstance(message, TaskStatusUpdated) and message.status in FINISHED_TASK_STATUSES:
            self.in_flight.pop(message.task_id, None)
        self.on_event(message)

    def _on_exit(self) -> None:
        if self.exited:
            return
        self.exited = True
        asyncio.get_running_loop().remove_reader(self._conn.fileno())
        self.process.join(timeout=5)
        exit_code = self.process.exitcode
        # A runner exits 0 only after shutting down in order: told to by its supervisor,
        # or, as a follower, by its rank 0 (whose node may see the deletion first). One
        # its supervisor had to kill after asking it to stop was shut down too.
        if exit_code == 0 or self.stopping:
            self.on_event(RunnerStatusUpdated(runner_id=self.runner_id, status=RunnerShutdown()))
            return
        message = self.failure_message or f"runner process exited unexpectedly (exit code {exit_code})"
        self.failure_message = message
        logger.error(f"runner {self.runner_id}: {message}")
        for task_id, command_id in self.in_flight.items():
            self.on_chunk(ChunkGenerated(command_id=command_id, finish_reason="error", error_message=message))
            self.on_event(TaskStatusUpdated(task_id=task_id, status=TaskStatus.Failed, error_message=message))
        self.in_flight.clear()
        self.on_event(
            RunnerStatusUpdated(
                runner_id=self.runner_id, status=RunnerFailed(error_message=message, attempt=self.attempt)
            )
        )

    def abandon(self, reason: str) -> None:
        """Kill the process at once, without asking: it may be blocked in a collective
        with a dead peer. What it was serving fails with `reason`."""
        self.failure_message = reason
        if self.process.is_alive():
            self.process.kill()
        self._on_exit()

    async def shutdown(self) -> None:
        self.send(Shutdown())
        self.stopping = True
        for _ in range(50):
            if self.exited or not self.process.is_alive():
                break
            await asyncio.sleep(0.1)
        if self.process.is_alive():
            self.process.kill()
        if not self.exited:
            self._on_exit()
        self._conn.close()
