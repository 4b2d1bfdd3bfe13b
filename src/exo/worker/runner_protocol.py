"""What a supervisor tells its runner subprocess, over a multiprocessing pipe. The runner
answers with events (RunnerStatusUpdated, TaskStatusUpdated) and ChunkGenerated."""

from typing import Literal

from exo.shared.types.common import CommandId, FrozenModel, TaskId
from exo.shared.types.text_generation import TextGenerationTaskParams


class ConnectToGroup(FrozenModel):
    kind: Literal["ConnectToGroup"] = "ConnectToGroup"


class LoadModel(FrozenModel):
    kind: Literal["LoadModel"] = "LoadModel"
    model_dir: str


class StartWarmup(FrozenModel):
    kind: Literal["StartWarmup"] = "StartWarmup"


class SubmitTask(FrozenModel):
    kind: Literal["SubmitTask"] = "SubmitTask"
    task_id: TaskId
    command_id: CommandId
    params: TextGenerationTaskParams


class CancelRunnerTask(FrozenModel):
    kind: Literal["CancelRunnerTask"] = "CancelRunnerTask"
    task_id: TaskId


class Shutdown(FrozenModel):
    kind: Literal["Shutdown"] = "Shutdown"


RunnerInstruction = ConnectToGroup | LoadModel | StartWarmup | SubmitTask | CancelRunnerTask | Shutdown
