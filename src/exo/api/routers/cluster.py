"""Cluster control: state, events, models and instances."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from exo.api import peer_files, peer_images
from exo.api.errors import ApiError
from exo.api.instance_watch import watch_instances
from exo.api.placing import card_or_404, place_disaggregated_model, place_model_when_settled, planned_instance
from exo.api.port import ClusterDep, ClusterPort
from exo.master.placement import PlacementPreview, instance_previews, instance_problem
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.commands import AddCustomModelCard, CreateInstance, DeleteCustomModelCard, DeleteInstance
from exo.shared.types.common import InstanceId, ModelId
from exo.shared.types.downloads import DownloadCompleted
from exo.shared.types.instances import Instance, InstanceMeta, Sharding
from exo.shared.types.state import State
from exo.worker import download

router = APIRouter()
router.include_router(peer_files.router)
router.include_router(peer_images.router)


class PlaceInstanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str
    sharding: Sharding = Sharding.Pipeline
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    min_nodes: int = Field(1, ge=1)
    # Room for this many tokens of KV cache; the card's context length by default.
    context_length: int | None = Field(None, ge=1)
    # A draft model for speculative decoding; the card's draft_model by default.
    draft_model: str | None = None
    # Disaggregated serving: the model whole on both nodes, decode_node_id serving it and
    # prefill_node_id prefilling its prompts of prefill_min_tokens or more (512 by default).
    prefill_node_id: str | None = None
    decode_node_id: str | None = None
    prefill_min_tokens: int | None = Field(None, ge=1)


class CreateInstanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance: Instance


class InstanceCommandResponse(BaseModel):
    message: str
    command_id: str
    instance_id: str


@router.get("/node_id")
def get_node_id(cluster: ClusterDep) -> str:
    return cluster.node_id


@router.get("/state")
def get_state(cluster: ClusterDep) -> dict[str, Any]:
    return cluster.state.model_dump(mode="json")


@router.get("/events")
async def get_events(response: Response, cluster: ClusterDep, since: int = Query(0, ge=0)) -> list[dict[str, Any]]:
    """The events from `since` on that this node holds. Older ones were compacted into a
    snapshot: the X-Exo-History-Start header says from which index the node has history.
    On the event loop, not a worker thread: the replica appends, snapshots and deletes
    segments there, and a read in between would find a segment gone."""
    response.headers["X-Exo-History-Start"] = str(cluster.history.start)
    return [event.model_dump(mode="json") for event in cluster.history[since:]]


@router.get("/models")
def get_models(cluster: ClusterDep, status: Literal["downloaded"] | None = None) -> list[ModelCard]:
    """Every card; with status=downloaded, those whose weights are on some node already
    (in a models dir of this node, or downloaded by any node of the cluster)."""
    cards = cluster.cards()
    if status == "downloaded":
        on_disk = cluster.local_model_ids()
        downloaded = {
            model_id
            for per_model in cluster.state.downloads.values()
            for model_id, progress in per_model.items()
            if isinstance(progress, DownloadCompleted)
        }
        cards = {model_id: card for model_id, card in cards.items() if model_id in on_disk | downloaded}
    return sorted(cards.values(), key=lambda card: card.model_id)


class CommandResponse(BaseModel):
    message: str
    command_id: str


@router.post("/models")
def add_custom_model_card(cluster: ClusterDep, card: ModelCard) -> CommandResponse:
    """Teach the cluster a model it has no card for; the card is replicated with State."""
    if card.model_id in cluster.cards() and card.model_id not in cluster.state.custom_model_cards:
        raise ApiError(409, f"model '{card.model_id}' already has a built-in or local card", code="model_exists")
    command = AddCustomModelCard(card=card)
    cluster.send_command(command)
    return CommandResponse(message=f"adding card {card.model_id}", command_id=command.command_id)


class AddModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(description="a Hugging Face hub id, org/name")


@router.post("/models/add")
async def add_model_from_hub(cluster: ClusterDep, body: AddModelRequest) -> ModelCard:
    """A card for any hub model, derived from its config.json and the weight sizes the hub
    lists (the weights download when the model is placed). A model that already has a
    card gets that card back."""
    known = cluster.cards().get(body.model_id)
    if known is not None:
        return known
    if cluster.settings.offline:
        raise ApiError(
            400,
            "this node is offline (--offline): put the model in a models dir, or add its card with POST /models",
            code="offline",
            param="model_id",
        )
    try:
        card = await asyncio.to_thread(download.fetch_card, body.model_id)
    except download.InvalidModelId as error:
        raise ApiError(400, str(error), code="invalid_model_id", param="model_id") from error
    except download.ModelNotOnHub as error:
        raise ApiError(404, str(error), code="model_not_found", param="model_id") from error
    except download.ModelNeedsToken as error:
        raise ApiError(403, str(error), code="hub_token_required", param="model_id") from error
    except download.HubUnreachable as error:
        raise ApiError(502, str(error), code="hub_unreachable") from error
    except download.HubBusy as error:
        raise ApiError(503, str(error), code="hub_busy") from error
    except download.DownloadError as error:
        raise ApiError(422, str(error), code="unusable_model", param="model_id") from error
    cluster.send_command(AddCustomModelCard(card=card))
    return card


@router.delete("/models/{model_id:path}")
def delete_custom_model_card(cluster: ClusterDep, model_id: str) -> CommandResponse:
    if model_id not in cluster.state.custom_model_cards:
        raise ApiError(404, f"'{model_id}' is not a custom model card", code="model_not_found")
    command = DeleteCustomModelCard(model_id=ModelId(model_id))
    cluster.send_command(command)
    return CommandResponse(message=f"deleting card {model_id}", command_id=command.command_id)


MAX_PROBE_BYTES = 64 * 2**20
PROBE_CHUNK = bytes(64 * 2**10)


@router.get("/link_probe")
async def link_probe(size: int = Query(0, ge=0, le=MAX_PROBE_BYTES)) -> StreamingResponse:
    """Bytes for other nodes to time: how they measure the bandwidth of the link to us.
    Sent from one small block: every peer probes every few seconds, and a whole body
    per probe moved this node's memory by megabytes at a time."""

    async def zeros() -> AsyncIterator[bytes]:
        for start in range(0, size, len(PROBE_CHUNK)):
            yield PROBE_CHUNK[: size - start]

    headers = {"Content-Length": str(size)}
    return StreamingResponse(zeros(), media_type="application/octet-stream", headers=headers)


@router.post("/place_instance")
async def post_place_instance(cluster: ClusterDep, body: PlaceInstanceRequest) -> InstanceCommandResponse:
    if body.prefill_node_id is not None or body.decode_node_id is not None:
        if body.prefill_node_id is None or body.decode_node_id is None:
            raise ApiError(400, "give both prefill_node_id and decode_node_id", code="invalid_request")
        command = place_disaggregated_model(
            cluster,
            body.model_id,
            body.prefill_node_id,
            body.decode_node_id,
            body.context_length,
            body.prefill_min_tokens,
        )
        return InstanceCommandResponse(
            message=f"placing {body.model_id}, prefilled on {body.prefill_node_id}",
            command_id=command.command_id,
            instance_id=command.instance.instance_id,
        )
    command = await place_model_when_settled(
        cluster, body.model_id, body.sharding, body.min_nodes, body.context_length, body.draft_model
    )
    return InstanceCommandResponse(
        message=f"placing {body.model_id}", command_id=command.command_id, instance_id=command.instance.instance_id
    )


@router.post("/instance")
def post_instance(cluster: ClusterDep, body: CreateInstanceRequest) -> InstanceCommandResponse:
    card = card_or_404(cluster, body.instance.model_id)
    state = cluster.state
    if body.instance.instance_id in state.instances:
        raise ApiError(409, f"instance {body.instance.instance_id} already exists", code="instance_exists")
    problem = instance_problem(state, body.instance)
    shard = next(iter(body.instance.shard_assignments.runner_to_shard.values()))
    if problem is None and shard.n_layers != card.n_layers:
        problem = f"{card.model_id} has {card.n_layers} layers, but the shards say {shard.n_layers}"
    if problem is not None:
        raise ApiError(400, f"cannot create this instance: {problem}", code="invalid_instance", param="instance")
    command = CreateInstance(instance=body.instance)
    cluster.send_command(command)
    return InstanceCommandResponse(
        message="creating instance", command_id=command.command_id, instance_id=body.instance.instance_id
    )


@router.get("/instance/previews")
def get_instance_previews(
    cluster: ClusterDep,
    model_id: str,
    sharding: Sharding | None = None,
    min_nodes: int = Query(1, ge=1),
    context_length: int | None = Query(None, ge=1),
) -> list[PlacementPreview]:
    """Every placement option, Pipeline and Tensor unless one is asked for, with the
    reason each rejected option cannot work."""
    return instance_previews(cluster.state, card_or_404(cluster, model_id), sharding, min_nodes, context_length)


@router.get("/instance/placement")
def get_instance_placement(
    cluster: ClusterDep,
    model_id: str,
    sharding: Sharding = Sharding.Pipeline,
    min_nodes: int = Query(1, ge=1),
    context_length: int | None = Query(None, ge=1),
) -> Instance:
    """The instance /place_instance would create for these arguments, without creating it."""
    return planned_instance(cluster, model_id, sharding, min_nodes, context_length)


def _instance_or_404(state: State, instance_id: str) -> Instance:
    instance = state.instances.get(InstanceId(instance_id))
    if instance is None:
        raise ApiError(404, f"instance {instance_id} does not exist", code="instance_not_found")
    return instance


@router.get("/instance/await")
async def await_instance(
    cluster: ClusterDep,
    instance_id: str | None = None,
    model_id: str | None = None,
    timeout: float = Query(600, gt=0),
) -> StreamingResponse:
    """Server-sent events with the runners' statuses until the instance (or any
    instance of the model) serves, fails or disappears."""
    if instance_id is None and model_id is None:
        raise ApiError(400, "give instance_id or model_id", code="invalid_request")
    if model_id is not None:
        card_or_404(cluster, model_id)
    return StreamingResponse(_await_events(cluster, instance_id, model_id, timeout), media_type="text/event-stream")


async def _await_events(
    cluster: ClusterPort, instance_id: str | None, model_id: str | None, timeout: float
) -> AsyncIterator[str]:
    def sse(event: str, data: dict[str, Any]) -> str:
        return f"event: {event}\ndata: {json.dumps(data)}\n\n"

    last_sent = None
    async for seen in watch_instances(cluster, instance_id, model_id):
        update = {r: (s.model_dump(mode="json") if s else None) for r, s in seen.statuses.items()}
        if update != last_sent:
            last_sent = update
            yield sse("status", {"runners": update})
        if seen.ready is not None:
            yield sse("ready", {"instance_id": seen.ready.instance_id})
            return
        if seen.failures and instance_id is not None:
            yield sse("error", {"message": seen.failures[0]})
            return
        if seen.gone is not None:
            yield sse("error", {"message": seen.gone})
            return
        if seen.waited >= timeout:
            yield sse("error", {"message": "timed out waiting for the instance"})
            return


@router.get("/instance/{instance_id}")
def get_instance(cluster: ClusterDep, instance_id: str) -> Instance:
    return _instance_or_404(cluster.state, instance_id)


@router.delete("/instance/{instance_id}")
def delete_instance(cluster: ClusterDep, instance_id: str) -> InstanceCommandResponse:
    instance = _instance_or_404(cluster.state, instance_id)
    command = DeleteInstance(instance_id=instance.instance_id)
    cluster.send_command(command)
    return InstanceCommandResponse(
        message="deleting instance", command_id=command.command_id, instance_id=instance.instance_id
    )
