"""Ollama's API under /ollama/api/: chat, generate, tags, show, ps, version. Point an
Ollama client at http://HOST:52415/ollama."""

import time
from importlib.metadata import version as package_version
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from exo.api.adapters.ollama import (
    OllamaChatRequest,
    OllamaEncoder,
    OllamaGenerateRequest,
    chat_task_params,
    generate_task_params,
    model_entry,
    now,
    show_body,
)
from exo.api.checks import model_think_markers
from exo.api.generation import respond
from exo.api.listing import servable_cards
from exo.api.placing import AutoPlacerDep, card_or_404
from exo.api.port import ClusterDep, ClusterPort

router = APIRouter(prefix="/ollama/api")


def _model_name(cluster: ClusterPort, model: str) -> str:
    """Ollama clients add a ":latest" tag to names that have none."""
    if model not in cluster.cards() and model.endswith(":latest"):
        return model.removesuffix(":latest")
    return model


@router.post("/chat")
async def chat(request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: OllamaChatRequest):
    started = time.monotonic_ns()
    body.model = _model_name(cluster, body.model)
    encoder = OllamaEncoder(body.model, "chat", started)
    return await respond(request, cluster, placer, chat_task_params(body), lambda _: encoder, body.stream)


@router.post("/generate")
async def generate(request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: OllamaGenerateRequest):
    started = time.monotonic_ns()
    body.model = _model_name(cluster, body.model)
    if not body.prompt and not body.images:
        # An empty prompt is how Ollama clients ask for a model to be loaded.
        placer.require_instance(cluster, body.model)
        return {"model": body.model, "created_at": now(), "response": "", "done": True, "done_reason": "load"}
    encoder = OllamaEncoder(body.model, "generate", started)
    return await respond(request, cluster, placer, generate_task_params(body), lambda _: encoder, body.stream)


@router.get("/tags")
def tags(cluster: ClusterDep) -> dict[str, Any]:
    """What this cluster can serve (see api/listing.py), as /v1/models lists it."""
    return {"models": [model_entry(card) for card in servable_cards(cluster)]}


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)


@router.post("/show")
def show(cluster: ClusterDep, body: ShowRequest) -> dict[str, Any]:
    card = card_or_404(cluster, _model_name(cluster, body.model))
    return show_body(card, thinks=model_think_markers(cluster, card.model_id) is not None)


@router.get("/ps")
def ps(cluster: ClusterDep) -> dict[str, Any]:
    cards = cluster.cards()
    running = []
    for instance in cluster.state.instances.values():
        card = cards.get(instance.model_id)
        if card is not None:
            entry = model_entry(card)
            entry |= {"size_vram": entry["size"], "expires_at": "2999-01-01T00:00:00Z"}
            running.append(entry | {"context_length": card.context_length})
    return {"models": running}


@router.get("/version")
def version() -> dict[str, str]:
    return {"version": package_version("exo")}
