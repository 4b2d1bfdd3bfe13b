"""Everything that changes State. The master gives each event a global index."""

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import (
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.downloads import DownloadOrder, DownloadProgress
from exo.shared.types.instances import Instance
from exo.shared.types.nodes import NodeInfo
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.tasks import TaskStatus, TextGenerationTask
from exo.shared.types.topology import Connection


class MasterElected(FrozenModel):
    kind: Literal["MasterElected"] = "MasterElected"
    node_id: NodeId


class NodeGatheredInfo(FrozenModel):
    kind: Literal["NodeGatheredInfo"] = "NodeGatheredInfo"
    info: NodeInfo


class NodeTimedOut(FrozenModel):
    """The node left the cluster: its info, downloads and links leave State (the master
    deletes its instances first)."""

    kind: Literal["NodeTimedOut"] = "NodeTimedOut"
    node_id: NodeId


class InstanceCreated(FrozenModel):
    kind: Literal["InstanceCreated"] = "InstanceCreated"
    instance: Instance


class InstanceDeleted(FrozenModel):
    """Its runners leave State with it; the reason is kept for whoever asks later."""

    kind: Literal["InstanceDeleted"] = "InstanceDeleted"
    instance_id: InstanceId
    reason: str = ""


class InstanceRingMoved(FrozenModel):
    """The instance's ring addresses changed (a rank's port was taken on its node): its
    runners restart on the new ones."""

    kind: Literal["InstanceRingMoved"] = "InstanceRingMoved"
    instance_id: InstanceId
    hosts: list[str]
    reason: str = ""


class RunnerStatusUpdated(FrozenModel):
    """A late report from a runner of a deleted instance changes nothing."""

    kind: Literal["RunnerStatusUpdated"] = "RunnerStatusUpdated"
    runner_id: RunnerId
    status: RunnerStatus


class TaskCreated(FrozenModel):
    kind: Literal["TaskCreated"] = "TaskCreated"
    task: TextGenerationTask


class TaskStatusUpdated(FrozenModel):
    kind: Literal["TaskStatusUpdated"] = "TaskStatusUpdated"
    task_id: TaskId
    status: TaskStatus
    error_message: str | None = None


class TaskDeleted(FrozenModel):
    """The task is done with (collected, or its client is gone); a runner still
    generating it stops."""

    kind: Literal["TaskDeleted"] = "TaskDeleted"
    task_id: TaskId


class CustomModelCardAdded(FrozenModel):
    kind: Literal["CustomModelCardAdded"] = "CustomModelCardAdded"
    card: ModelCard


class CustomModelCardDeleted(FrozenModel):
    kind: Literal["CustomModelCardDeleted"] = "CustomModelCardDeleted"
    model_id: ModelId


class NodeDownloadProgress(FrozenModel):
    kind: Literal["NodeDownloadProgress"] = "NodeDownloadProgress"
    node_id: NodeId
    model_id: ModelId
    progress: DownloadProgress


class DownloadOrdered(FrozenModel):
    """The master accepted a download command for that node; its worker carries it out.
    A new "start" drops a failed or cancelled record, so the download runs again."""

    kind: Literal["DownloadOrdered"] = "DownloadOrdered"
    node_id: NodeId
    model_id: ModelId
    order: DownloadOrder
    # For "start": the layers whose files to fetch; None: the whole model.
    layers: tuple[int, int] | None = None


class NodeDownloadDeleted(FrozenModel):
    """The node deleted its files of the model: its record and order leave State."""

    kind: Literal["NodeDownloadDeleted"] = "NodeDownloadDeleted"
    node_id: NodeId
    model_id: ModelId


class TopologyEdgeUpdated(FrozenModel):
    """Inserts the edge connection.source -> connection.sink, or replaces it."""

    kind: Literal["TopologyEdgeUpdated"] = "TopologyEdgeUpdated"
    connection: Connection


class TopologyEdgeDeleted(FrozenModel):
    kind: Literal["TopologyEdgeDeleted"] = "TopologyEdgeDeleted"
    source: NodeId
    sink: NodeId


Event = Annotated[
    MasterElected
    | NodeGatheredInfo
    | NodeTimedOut
    | InstanceCreated
    | InstanceDeleted
    | InstanceRingMoved
    | RunnerStatusUpdated
    | TaskCreated
    | TaskStatusUpdated
    | TaskDeleted
    | NodeDownloadProgress
    | DownloadOrdered
    | NodeDownloadDeleted
    | CustomModelCardAdded
    | CustomModelCardDeleted
    | TopologyEdgeUpdated
    | TopologyEdgeDeleted,
    Field(discriminator="kind"),
]


class IndexedEvent(FrozenModel):
    idx: int = Field(ge=0)
    event: Event
