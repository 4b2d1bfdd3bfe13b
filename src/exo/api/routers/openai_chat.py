"""OpenAI-compatible endpoints: /v1/models and /v1/chat/completions, plus exo's
/bench/chat/completions."""

from typing import Any

from fastapi import APIRouter, Request

from exo.api.adapters.chat_completions import ChatCompletionEncoder, ChatCompletionRequest, to_task_params
from exo.api.errors import ApiError
from exo.api.generation import respond
from exo.api.listing import servable_cards
from exo.api.placing import AutoPlacerDep
from exo.api.port import ClusterDep
from exo.engine.llamacpp.support import card_formats

router = APIRouter()


@router.get("/v1/models")
def list_models(cluster: ClusterDep) -> dict[str, Any]:
    """What this cluster can serve (see api/listing.py); /models has the whole catalog."""
    return {
        "object": "list",
        "data": [
            {
                "id": card.model_id,
                "object": "model",
                "created": 0,
                "owned_by": card.model_id.split("/")[0],
                "name": card.base_model or card.model_id,
                "family": card.family,
                "quantization": card.quantization,
                "capabilities": list(card.capabilities),
                "context_length": card.context_length,
                "reasoning_dialect": card.reasoning_dialect.value,
                "storage_size_bytes": card.storage_size.in_bytes,
                "formats": card_formats(card),
            }
            for card in servable_cards(cluster)
        ],
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: ChatCompletionRequest):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(
        request,
        cluster,
        placer,
        to_task_params(body),
        # POST /v1/cancel/{id} takes this id.
        lambda command_id: ChatCompletionEncoder(f"chatcmpl-{command_id}", body.model, include_usage),
        bool(body.stream),
    )


@router.post("/bench/chat/completions")
async def bench_chat_completions(
    request: Request, cluster: ClusterDep, placer: AutoPlacerDep, body: ChatCompletionRequest
):
    """A non-streamed chat completion whose generation_stats (prompt and generation
    tokens/s, token counts, the runner's peak memory) are always filled: for benchmarks."""
    if body.stream:
        raise ApiError(400, "the bench endpoint answers in one piece; send stream: false", param="stream")
    return await chat_completions(request, cluster, placer, body)
