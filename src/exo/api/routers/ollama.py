"""Ollama's API under /ollama/api/: chat, generate, tags, show, ps, version. Point an
Ollama client at http://HOST:52415/ollama."""

import time
from collections.abc import AsyncIterator
from importlib.metadata import version as package_version
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from exo.api.adapters.ollama import (
    OllamaChatRequest,
    OllamaEncoder,
    OllamaGenerateRequest,
    OllamaRequestBase,
    chat_task_params,
    generate_task_params,
    model_entry,
    ndjson,
    now,
    show_body,
)
from exo.api.generation import Generation, generation_error, require_instance, start_generation, stream_response
from exo.api.routers.cluster import card_or_404, node_of
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams

router = APIRouter(prefix="/ollama/api")


def _model_name(request: Request, model: str) -> str:
    """Ollama clients add a ":latest" tag to names that have none."""
    if model not in node_of(request).cards() and model.endswith(":latest"):
        return model.removesuffix(":latest")
    return model


async def _answer(
    request: Request, body: OllamaRequestBase, params: TextGenerationTaskParams, encoder: OllamaEncoder
) -> Any:
    generation: Generation = await start_generation(request, params, body.stream)
    if body.stream:

        async def lines(chunks: AsyncIterator[ChunkGenerated]) -> AsyncIterator[str]:
            async for chunk in chunks:
                for line in encoder.feed(chunk, time.monotonic_ns()):
                    yield ndjson(line)

        return stream_response(generation, lines, media_type="application/x-ndjson")

    chunks = await generation.collect(request)
    if chunks[-1].finish_reason == "error":
        raise generation_error(chunks[-1])
    for chunk in chunks:
        encoder.feed(chunk, time.monotonic_ns())
    return encoder.body()


@router.post("/chat")
async def chat(request: Request, body: OllamaChatRequest):
    started = time.monotonic_ns()
    body.model = _model_name(request, body.model)
    return await _answer(request, body, chat_task_params(body), OllamaEncoder(body.model, "chat", started))


@router.post("/generate")
async def generate(request: Request, body: OllamaGenerateRequest):
    started = time.monotonic_ns()
    body.model = _model_name(request, body.model)
    if not body.prompt and not body.images:
        # An empty prompt is how Ollama clients ask for a model to be loaded.
        require_instance(request, body.model)
        return {"model": body.model, "created_at": now(), "response": "", "done": True, "done_reason": "load"}
    return await _answer(request, body, generate_task_params(body), OllamaEncoder(body.model, "generate", started))


@router.get("/tags")
def tags(request: Request) -> dict[str, Any]:
    cards = node_of(request).cards()
    return {"models": [model_entry(card) for card in sorted(cards.values(), key=lambda c: c.model_id)]}


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)


@router.post("/show")
def show(request: Request, body: ShowRequest) -> dict[str, Any]:
    return show_body(card_or_404(node_of(request), _model_name(request, body.model)))


@router.get("/ps")
def ps(request: Request) -> dict[str, Any]:
    node = node_of(request)
    cards = node.cards()
    running = []
    for instance in node.replica.state.instances.values():
        card = cards.get(instance.model_id)
        if card is not None:
            entry = model_entry(card)
            entry |= {"size_vram": entry["size"], "expires_at": "2999-01-01T00:00:00Z"}
            running.append(entry | {"context_length": card.context_length})
    return {"models": running}


@router.get("/version")
def version() -> dict[str, str]:
    return {"version": package_version("exo")}
