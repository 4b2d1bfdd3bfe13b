"""What a supervisor tells its runner subprocess, over a multiprocessing pipe (pickled,
so plain frozen dataclasses). The runner answers with the events it causes
(RunnerStatusUpdated, TaskStatusUpdated) and ChunkGenerated."""

from dataclasses import dataclass

from exo.shared.types.common import RunnerId, TaskId
from exo.shared.types.instances import Instance
from exo.shared.types.tasks import TextGenerationTask


@dataclass(frozen=True)
class BecomeRunner:
    """A spare runner process's first message: which runner of which instance it is."""

    runner_id: RunnerId
    instance: Instance


@dataclass(frozen=True)
class ConnectToGroup:
    pass


@dataclass(frozen=True)
class LoadModel:
    model_dir: str
    # (model id, dir) of the instance's draft model, on rank 0.
    draft: tuple[str, str] | None = None


@dataclass(frozen=True)
class StartWarmup:
    pass


@dataclass(frozen=True)
class SubmitTask:
    task: TextGenerationTask


@dataclass(frozen=True)
class CancelRunnerTask:
    task_id: TaskId


@dataclass(frozen=True)
class Shutdown:
    pass


# The steps every runner goes through once, in this order, before it serves.
LifecycleInstruction = ConnectToGroup | LoadModel | StartWarmup
RunnerInstruction = LifecycleInstruction | SubmitTask | CancelRunnerTask | Shutdown
