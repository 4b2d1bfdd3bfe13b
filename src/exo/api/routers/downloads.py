"""Download control (upstream exo's endpoints): start a model's download on a node with no
instance, cancel a running one (its verified bytes stay for a resume), delete a node's
files of a model; and the hub's model search. Each command goes to the master, which
orders the node's worker through State (`download_orders`)."""

import asyncio
from typing import Any

from fastapi import APIRouter, Query
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from exo.api.errors import ApiError
from exo.api.placing import card_or_404
from exo.api.port import ClusterDep, ClusterPort
from exo.shared.models.model_cards import ModelCard
from exo.shared.queries import download_running, instance_using_files
from exo.shared.types.commands import CancelDownload, DeleteDownload, StartDownload
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.downloads import DownloadCompleted
from exo.worker.download import hub

router = APIRouter()


class DownloadRequest(BaseModel):
    """`{"model_id", "node_id", "layers"}`; upstream exo's `{"targetNodeId",
    "shardMetadata"}` (or `{"targetNodeId", "modelId"}` for a cancel) is read too, the
    model id from the shard's card and the layers from its start and end layer."""

    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(validation_alias=AliasChoices("model_id", "modelId"))
    # The node to download on; this node by default.
    node_id: str | None = Field(None, validation_alias=AliasChoices("node_id", "target_node_id", "targetNodeId"))
    # Only the files of layers [start, end) (a pipeline rank's); the whole model by default.
    layers: tuple[int, int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _model_of_upstream_shard(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            return body
        rest = {k: v for k, v in body.items() if k not in ("shardMetadata", "shard_metadata")}
        shard = body.get("shardMetadata", body.get("shard_metadata"))
        if shard is None:
            return body
        card = (shard.get("modelCard") or shard.get("model_card")) if isinstance(shard, dict) else None
        model_id = (card.get("modelId") or card.get("model_id")) if isinstance(card, dict) else None
        if not isinstance(model_id, str):
            raise ValueError("shardMetadata has no modelCard.modelId")
        start = shard.get("startLayer", shard.get("start_layer"))
        end = shard.get("endLayer", shard.get("end_layer"))
        layers = [start, end] if start is not None and end is not None else None
        return {**rest, "model_id": model_id, "layers": layers}


class DownloadCommandResponse(BaseModel):
    message: str
    command_id: str
    node_id: str
    model_id: str


def _node_or_404(cluster: ClusterPort, node_id: str | None) -> NodeId:
    node_id = node_id or cluster.node_id
    if NodeId(node_id) not in cluster.state.nodes:
        raise ApiError(404, f"node {node_id} is not in the cluster", code="node_not_found", param="node_id")
    return NodeId(node_id)


def _refuse_if_in_use(cluster: ClusterPort, node_id: NodeId, model_id: str, doing: str) -> None:
    instance = instance_using_files(cluster.state, node_id, model_id)
    if instance is not None:
        raise ApiError(
            409,
            f"cannot {doing} {model_id} on node {node_id}: instance {instance.instance_id} uses its files; "
            "delete the instance first",
            code="model_in_use",
        )


def _send(
    cluster: ClusterPort, command: StartDownload | CancelDownload | DeleteDownload, message: str
) -> DownloadCommandResponse:
    cluster.send_command(command)
    return DownloadCommandResponse(
        message=message, command_id=command.command_id, node_id=command.node_id, model_id=command.model_id
    )


def _layers(card: ModelCard, layers: tuple[int, int] | None) -> tuple[int, int] | None:
    """The layer range to download, checked against the card; None for every layer."""
    if layers is None or layers == (0, card.n_layers):
        return None
    start, end = layers
    if not 0 <= start < end <= card.n_layers:
        raise ApiError(
            400,
            f"layers {list(layers)} are not a range [start, end) of {card.model_id}'s {card.n_layers} layers",
            code="invalid_layers",
            param="layers",
        )
    return layers


@router.post("/download/start")
def start_download(cluster: ClusterDep, body: DownloadRequest) -> DownloadCommandResponse:
    node_id = _node_or_404(cluster, body.node_id)
    layers = _layers(card_or_404(cluster, body.model_id), body.layers)
    command = StartDownload(node_id=node_id, model_id=ModelId(body.model_id), layers=layers)
    of = f"layers {layers[0]}-{layers[1] - 1} of " if layers else ""
    return _send(cluster, command, f"downloading {of}{body.model_id} on node {node_id}")


@router.post("/download/cancel")
def cancel_download(cluster: ClusterDep, body: DownloadRequest) -> DownloadCommandResponse:
    node_id = _node_or_404(cluster, body.node_id)
    card_or_404(cluster, body.model_id)
    _refuse_if_in_use(cluster, node_id, body.model_id, "cancel the download of")
    if not download_running(cluster.state, node_id, body.model_id):
        raise ApiError(409, f"no download of {body.model_id} is running on node {node_id}", code="download_not_running")
    command = CancelDownload(node_id=node_id, model_id=ModelId(body.model_id))
    return _send(cluster, command, f"cancelling the download of {body.model_id} on node {node_id}")


@router.delete("/download/{node_id}/{model_id:path}")
def delete_download(cluster: ClusterDep, node_id: str, model_id: str) -> DownloadCommandResponse:
    target = _node_or_404(cluster, node_id)
    record = cluster.state.downloads.get(target, {}).get(ModelId(model_id))
    if record is None:
        card_or_404(cluster, model_id)
        raise ApiError(404, f"node {target} holds no files of {model_id}", code="download_not_found")
    _refuse_if_in_use(cluster, target, model_id, "delete")
    if isinstance(record, DownloadCompleted) and record.read_only:
        raise ApiError(
            409,
            f"{model_id} on node {target} is in a read-only models dir ({record.path}); exo never deletes there",
            code="read_only_model_dir",
        )
    command = DeleteDownload(node_id=target, model_id=ModelId(model_id))
    return _send(cluster, command, f"deleting the files of {model_id} on node {target}")


class HubModelResult(hub.HubModel):
    # The cluster already has a card for it (it can be placed without /models/add).
    known: bool


@router.get("/models/search")
async def search_models(
    cluster: ClusterDep,
    q: str = "",
    query: str | None = None,
    limit: int = Query(20, ge=1, le=100),
) -> list[HubModelResult]:
    """The hub's model search (`q`, or upstream's `query`); a clear 503 when this node is
    offline or the hub does not answer."""
    if cluster.settings.offline:
        raise ApiError(503, "this node is offline (--offline or EXO_OFFLINE): it cannot search the hub", code="offline")
    try:
        found = await asyncio.to_thread(hub.search_models, query or q, limit)
    except (hub.HubUnreachable, hub.HubBusy) as error:
        raise ApiError(503, f"cannot search the hub: {error}", code="hub_unreachable", retry_after=30) from error
    except hub.DownloadError as error:
        raise ApiError(502, f"the hub's search failed: {error}", code="hub_error") from error
    cards = cluster.cards()
    return [HubModelResult(**model.model_dump(), known=model.id in cards) for model in found]
