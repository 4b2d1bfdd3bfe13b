"""Work the cluster has accepted. Only text generation lives in State; the worker's own
steps (create a runner, load, ...) are planner decisions, see exo.worker.planner."""

from enum import StrEnum

from exo.shared.types.common import CommandId, FrozenModel, InstanceId, TaskId
from exo.shared.types.text_generation import TextGenerationTaskParams


class TaskStatus(StrEnum):
    Pending = "Pending"
    Running = "Running"
    Complete = "Complete"
    Failed = "Failed"
    Cancelled = "Cancelled"


FINISHED_TASK_STATUSES = (TaskStatus.Complete, TaskStatus.Failed, TaskStatus.Cancelled)


class TextGenerationTask(FrozenModel):
    task_id: TaskId
    command_id: CommandId
    instance_id: InstanceId
    origin_session: str
    params: TextGenerationTaskParams
    status: TaskStatus = TaskStatus.Pending
    error_message: str | None = None
