"""What nodes ask the master to do. Every command carries its own id."""

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import CommandId, FrozenModel, InstanceId, ModelId, NodeId, new_id
from exo.shared.types.instances import Instance
from exo.shared.types.text_generation import TextGenerationTaskParams


class CommandBase(FrozenModel):
    command_id: CommandId = Field(default_factory=lambda: CommandId(new_id()))


class CreateInstance(CommandBase):
    kind: Literal["CreateInstance"] = "CreateInstance"
    instance: Instance


class DeleteInstance(CommandBase):
    kind: Literal["DeleteInstance"] = "DeleteInstance"
    instance_id: InstanceId
    reason: str = "deleted by request"


class TextGeneration(CommandBase):
    kind: Literal["TextGeneration"] = "TextGeneration"
    params: TextGenerationTaskParams
    # The node process whose API holds the client's stream (changes when a node restarts).
    origin_session: str


class TaskFinished(CommandBase):
    """The API is done with the stream of the TextGeneration command `finished_command_id`,
    because it ended or because the client left; the master drops the task from State,
    which also stops its generation."""

    kind: Literal["TaskFinished"] = "TaskFinished"
    finished_command_id: CommandId


class AddCustomModelCard(CommandBase):
    kind: Literal["AddCustomModelCard"] = "AddCustomModelCard"
    card: ModelCard


class DeleteCustomModelCard(CommandBase):
    kind: Literal["DeleteCustomModelCard"] = "DeleteCustomModelCard"
    model_id: ModelId


class _DownloadCommand(CommandBase):
    node_id: NodeId
    model_id: ModelId


class StartDownload(_DownloadCommand):
    """Download the model on that node, with no instance placed: the files of `layers`
    [start, end) (a pipeline rank's), or the whole model."""

    kind: Literal["StartDownload"] = "StartDownload"
    layers: tuple[int, int] | None = None


class CancelDownload(_DownloadCommand):
    """Stop that node's running download of the model, keeping its verified bytes."""

    kind: Literal["CancelDownload"] = "CancelDownload"


class DeleteDownload(_DownloadCommand):
    """Delete that node's files of the model (in writable models dirs only)."""

    kind: Literal["DeleteDownload"] = "DeleteDownload"


class MoveRingPort(CommandBase):
    """A worker found its rank's ring address `host` (an entry of the instance's hosts)
    already bound on its node, by another program or cluster: the master gives that rank
    another port before its runner binds."""

    kind: Literal["MoveRingPort"] = "MoveRingPort"
    instance_id: InstanceId
    node_id: NodeId
    host: str


class RequestEventLog(CommandBase):
    """A node saw a gap in the indexes; the master re-sends events from since_idx on."""

    kind: Literal["RequestEventLog"] = "RequestEventLog"
    since_idx: int


Command = Annotated[
    CreateInstance
    | DeleteInstance
    | TextGeneration
    | TaskFinished
    | AddCustomModelCard
    | DeleteCustomModelCard
    | StartDownload
    | CancelDownload
    | DeleteDownload
    | MoveRingPort
    | RequestEventLog,
    Field(discriminator="kind"),
]
