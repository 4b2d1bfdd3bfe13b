"""Cluster control: state, events, models and instances."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from exo.api.errors import ApiError
from exo.master.placement import (
    PlacementError,
    PlacementPreview,
    instance_previews,
    instance_problem,
    place_instance,
)
from exo.shared.models.model_cards import ModelCard, local_cards
from exo.shared.types.commands import AddCustomModelCard, CreateInstance, DeleteCustomModelCard, DeleteInstance
from exo.shared.types.common import InstanceId, ModelId
from exo.shared.types.downloads import DownloadCompleted
from exo.shared.types.instances import Instance, InstanceMeta, Sharding
from exo.shared.types.runners import SERVING_STATUSES, RunnerFailed
from exo.shared.types.state import State
from exo.worker.download import DownloadError, HubUnreachable, InvalidModelId, ModelNotOnHub, fetch_card

if TYPE_CHECKING:
    from exo.node import Node

router = APIRouter()


class PlaceInstanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str
    sharding: Sharding = Sharding.Pipeline
    instance_meta: InstanceMeta = InstanceMeta.MlxRing
    min_nodes: int = Field(1, ge=1)
    # Room for this many tokens of KV cache; the card's context length by default.
    context_length: int | None = Field(None, ge=1)


class CreateInstanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance: Instance


class InstanceCommandResponse(BaseModel):
    message: str
    command_id: str
    instance_id: str


def node_of(request: Request) -> "Node":
    return request.app.state.node


def card_or_404(node: "Node", model_id: str) -> ModelCard:
    card = node.cards().get(model_id)
    if card is None:
        raise ApiError(
            404, f"model '{model_id}' is not known to this cluster", code="model_not_found", param="model_id"
        )
    return card


def planned_instance(
    node: "Node", model_id: str, sharding: Sharding, min_nodes: int, context_length: int | None
) -> Instance:
    """Where placement would put the model now, or a 400 that says why it cannot go."""
    card = card_or_404(node, model_id)
    try:
        return place_instance(node.replica.state, card, sharding, min_nodes, context_length)
    except PlacementError as error:
        raise ApiError(400, str(error), code="placement_failed") from error


def place_model(
    node: "Node",
    model_id: str,
    sharding: Sharding = Sharding.Pipeline,
    min_nodes: int = 1,
    context_length: int | None = None,
) -> CreateInstance:
    instance = planned_instance(node, model_id, sharding, min_nodes, context_length)
    command = CreateInstance(instance=instance)
    node.send_command(command)
    return command


@router.get("/node_id")
def get_node_id(request: Request) -> str:
    return node_of(request).node_id


@router.get("/state")
def get_state(request: Request) -> dict[str, Any]:
    return node_of(request).replica.state.model_dump(mode="json")


@router.get("/events")
def get_events(request: Request, since: int = Query(0, ge=0)) -> list[dict[str, Any]]:
    return [event.model_dump(mode="json") for event in node_of(request).replica.history[since:]]


@router.get("/models")
def get_models(request: Request, status: Literal["downloaded"] | None = None) -> list[ModelCard]:
    """Every card; with status=downloaded, those whose weights are on some node already
    (in a models dir of this node, or downloaded by any node of the cluster)."""
    node = node_of(request)
    cards = node.cards()
    if status == "downloaded":
        on_disk = set(local_cards(node.config.exo_home))
        downloaded = {
            model_id
            for per_model in node.replica.state.downloads.values()
            for model_id, progress in per_model.items()
            if isinstance(progress, DownloadCompleted)
        }
        cards = {model_id: card for model_id, card in cards.items() if model_id in on_disk | downloaded}
    return sorted(cards.values(), key=lambda card: card.model_id)


class CommandResponse(BaseModel):
    message: str
    command_id: str


@router.post("/models")
def add_custom_model_card(request: Request, card: ModelCard) -> CommandResponse:
    """Teach the cluster a model it has no card for; the card is replicated with State."""
    node = node_of(request)
    if card.model_id in node.cards() and card.model_id not in node.replica.state.custom_model_cards:
        raise ApiError(409, f"model '{card.model_id}' already has a built-in or local card", code="model_exists")
    command = AddCustomModelCard(card=card)
    node.send_command(command)
    return CommandResponse(message=f"adding card {card.model_id}", command_id=command.command_id)


class AddModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(description="a Hugging Face hub id, org/name")


@router.post("/models/add")
async def add_model_from_hub(request: Request, body: AddModelRequest) -> ModelCard:
    """A card for any hub model, derived from its config.json and the weight sizes the hub
    lists (the weights download when the model is placed). A model that already has a
    card gets that card back."""
    node = node_of(request)
    known = node.cards().get(body.model_id)
    if known is not None:
        return known
    if node.config.offline:
        raise ApiError(
            400,
            "this node is offline (--offline): put the model in a models dir, or add its card with POST /models",
            code="offline",
            param="model_id",
        )
    try:
        card = await asyncio.to_thread(fetch_card, body.model_id)
    except InvalidModelId as error:
        raise ApiError(400, str(error), code="invalid_model_id", param="model_id") from error
    except ModelNotOnHub as error:
        raise ApiError(404, str(error), code="model_not_found", param="model_id") from error
    except HubUnreachable as error:
        raise ApiError(502, str(error), code="hub_unreachable") from error
    except DownloadError as error:
        raise ApiError(422, str(error), code="unusable_model", param="model_id") from error
    node.send_command(AddCustomModelCard(card=card))
    return card


@router.delete("/models/{model_id:path}")
def delete_custom_model_card(request: Request, model_id: str) -> CommandResponse:
    node = node_of(request)
    if model_id not in node.replica.state.custom_model_cards:
        raise ApiError(404, f"'{model_id}' is not a custom model card", code="model_not_found")
    command = DeleteCustomModelCard(model_id=ModelId(model_id))
    node.send_command(command)
    return CommandResponse(message=f"deleting card {model_id}", command_id=command.command_id)


MAX_PROBE_BYTES = 64 * 2**20


@router.get("/link_probe")
def link_probe(size: int = Query(0, ge=0, le=MAX_PROBE_BYTES)) -> Response:
    """Bytes for other nodes to time: how they measure the bandwidth of the link to us."""
    return Response(content=bytes(size), media_type="application/octet-stream")


@router.post("/place_instance")
def post_place_instance(request: Request, body: PlaceInstanceRequest) -> InstanceCommandResponse:
    command = place_model(node_of(request), body.model_id, body.sharding, body.min_nodes, body.context_length)
    return InstanceCommandResponse(
        message=f"placing {body.model_id}", command_id=command.command_id, instance_id=command.instance.instance_id
    )


@router.post("/instance")
def post_instance(request: Request, body: CreateInstanceRequest) -> InstanceCommandResponse:
    node = node_of(request)
    card = card_or_404(node, body.instance.model_id)
    state = node.replica.state
    if body.instance.instance_id in state.instances:
        raise ApiError(409, f"instance {body.instance.instance_id} already exists", code="instance_exists")
    problem = instance_problem(state, body.instance)
    shard = next(iter(body.instance.shard_assignments.runner_to_shard.values()))
    if problem is None and shard.n_layers != card.n_layers:
        problem = f"{card.model_id} has {card.n_layers} layers, but the shards say {shard.n_layers}"
    if problem is not None:
        raise ApiError(400, f"cannot create this instance: {problem}", code="invalid_instance", param="instance")
    command = CreateInstance(instance=body.instance)
    node.send_command(command)
    return InstanceCommandResponse(
        message="creating instance", command_id=command.command_id, instance_id=body.instance.instance_id
    )


@router.get("/instance/previews")
def get_instance_previews(
    request: Request,
    model_id: str,
    sharding: Sharding | None = None,
    min_nodes: int = Query(1, ge=1),
    context_length: int | None = Query(None, ge=1),
) -> list[PlacementPreview]:
    """Every placement option, Pipeline and Tensor unless one is asked for, with the
    reason each rejected option cannot work."""
    node = node_of(request)
    return instance_previews(node.replica.state, card_or_404(node, model_id), sharding, min_nodes, context_length)


@router.get("/instance/placement")
def get_instance_placement(
    request: Request,
    model_id: str,
    sharding: Sharding = Sharding.Pipeline,
    min_nodes: int = Query(1, ge=1),
    context_length: int | None = Query(None, ge=1),
) -> Instance:
    """The instance /place_instance would create for these arguments, without creating it."""
    return planned_instance(node_of(request), model_id, sharding, min_nodes, context_length)


def _instance_or_404(state: State, instance_id: str) -> Instance:
    instance = state.instances.get(InstanceId(instance_id))
    if instance is None:
        raise ApiError(404, f"instance {instance_id} does not exist", code="instance_not_found")
    return instance


@router.get("/instance/await")
async def await_instance(
    request: Request,
    instance_id: str | None = None,
    model_id: str | None = None,
    timeout: float = Query(600, gt=0),
) -> StreamingResponse:
    """Server-sent events with the runners' statuses until the instance (or any
    instance of the model) serves, fails or disappears."""
    if instance_id is None and model_id is None:
        raise ApiError(400, "give instance_id or model_id", code="invalid_request")
    node = node_of(request)
    if model_id is not None:
        card_or_404(node, model_id)
    return StreamingResponse(_await_events(node, instance_id, model_id, timeout), media_type="text/event-stream")


def _matching(state: State, instance_id: str | None, model_id: str | None) -> list[Instance]:
    return [
        i
        for i in state.instances.values()
        if (instance_id is None or i.instance_id == instance_id) and (model_id is None or i.model_id == model_id)
    ]


async def _await_events(
    node: "Node", instance_id: str | None, model_id: str | None, timeout: float
) -> AsyncIterator[str]:
    def sse(event: str, data: dict[str, Any]) -> str:
        return f"event: {event}\ndata: {json.dumps(data)}\n\n"

    loop = asyncio.get_running_loop()
    started = loop.time()
    last_sent = None
    while True:
        state = node.replica.state
        instances = _matching(state, instance_id, model_id)
        statuses = {
            runner_id: state.runners.get(runner_id)
            for instance in instances
            for runner_id in instance.shard_assignments.runner_to_shard
        }
        update = {r: (s.model_dump(mode="json") if s else None) for r, s in statuses.items()}
        if update != last_sent:
            last_sent = update
            yield sse("status", {"runners": update})
        for instance in instances:
            if all(
                isinstance(state.runners.get(r), SERVING_STATUSES) for r in instance.shard_assignments.runner_to_shard
            ):
                yield sse("ready", {"instance_id": instance.instance_id})
                return
        failed = [s for s in statuses.values() if isinstance(s, RunnerFailed)]
        if failed and instance_id is not None:
            yield sse("error", {"message": failed[0].error_message})
            return
        waited = loop.time() - started
        # A placement takes a moment to reach State; after that, a missing instance is gone.
        if instance_id is not None and not instances and waited > 5:
            yield sse("error", {"message": f"instance {instance_id} does not exist"})
            return
        if waited >= timeout:
            yield sse("error", {"message": "timed out waiting for the instance"})
            return
        try:
            await node.replica.wait_for(lambda s, seen=state: s is not seen, timeout=min(timeout - waited, 1.0))
        except TimeoutError:
            pass


@router.get("/instance/{instance_id}")
def get_instance(request: Request, instance_id: str) -> Instance:
    return _instance_or_404(node_of(request).replica.state, instance_id)


@router.delete("/instance/{instance_id}")
def delete_instance(request: Request, instance_id: str) -> InstanceCommandResponse:
    node = node_of(request)
    instance = _instance_or_404(node.replica.state, instance_id)
    command = DeleteInstance(instance_id=instance.instance_id)
    node.send_command(command)
    return InstanceCommandResponse(
        message="deleting instance", command_id=command.command_id, instance_id=instance.instance_id
    )
