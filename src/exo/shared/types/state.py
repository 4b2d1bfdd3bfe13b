"""The cluster's shared picture. Every node rebuilds it by applying the same events."""

import hashlib

from exo.shared.models.model_cards import ModelCard
from exo.shared.types.common import (
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.downloads import DownloadOrderEntry, DownloadProgress
from exo.shared.types.instances import Instance
from exo.shared.types.nodes import NodeInfo
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.tasks import TextGenerationTask
from exo.shared.types.topology import Topology


class State(FrozenModel):
    last_event_applied_idx: int = -1
    master_node_id: NodeId | None = None
    nodes: dict[NodeId, NodeInfo] = {}
    instances: dict[InstanceId, Instance] = {}
    runners: dict[RunnerId, RunnerStatus] = {}
    tasks: dict[TaskId, TextGenerationTask] = {}
    downloads: dict[NodeId, dict[ModelId, DownloadProgress]] = {}
    # Download orders (POST /download/start, /download/cancel, DELETE /download/...)
    # each node's worker has yet to carry out, or keeps following ("start").
    download_orders: dict[NodeId, dict[ModelId, DownloadOrderEntry]] = {}
    topology: Topology = Topology()
    # Cards added through the API; they live in the log, so they survive a failover.
    custom_model_cards: dict[ModelId, ModelCard] = {}
    # Why recent instances were deleted (the last MAX_DELETION_REASONS), newest last.
    instance_deletions: dict[InstanceId, str] = {}


MAX_DELETION_REASONS = 32


class StateSnapshot(FrozenModel):
    """The master's whole State, sent on the events topic to a replica that asked for
    events the master no longer holds (compacted into a snapshot) or that must start over."""

    snapshot: State


class StateDigest(FrozenModel):
    """The master's State as of event idx, digested (`state_digest`): sent every second
    after its newest event, so a node that wrote apart from it notices even where the
    events it still holds match the master's."""

    idx: int
    digest: str


def state_digest(state: State) -> str:
    return hashlib.sha256(state.model_dump_json().encode()).hexdigest()
