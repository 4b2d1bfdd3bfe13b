"""OpenAI-compatible endpoints: /v1/models and /v1/chat/completions, plus exo's
/bench/chat/completions."""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from exo.api.adapters.chat_completions import (
    ChatCompletionRequest,
    ChunkEncoder,
    completion_body,
    to_task_params,
)
from exo.api.errors import ApiError
from exo.api.generation import generation_error, start_generation, stream_response
from exo.api.routers.cluster import node_of
from exo.shared.types.text_generation import ChunkGenerated

router = APIRouter()


@router.get("/v1/models")
def list_models(request: Request) -> dict[str, Any]:
    cards = node_of(request).cards()
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
            }
            for card in sorted(cards.values(), key=lambda c: c.model_id)
        ],
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    generation = await start_generation(request, to_task_params(body), bool(body.stream))
    # POST /v1/cancel/{id} takes this id.
    completion_id = f"chatcmpl-{generation.command_id}"

    if body.stream:
        encoder = ChunkEncoder(
            completion_id, body.model, bool(body.stream_options and body.stream_options.include_usage)
        )

        async def sse(chunks: AsyncIterator[ChunkGenerated]) -> AsyncIterator[str]:
            async for chunk in chunks:
                for line in encoder.encode(chunk):
                    yield line
            yield "data: [DONE]\n\n"

        return stream_response(generation, sse)

    chunks = await generation.collect(request)
    if chunks[-1].finish_reason == "error":
        raise generation_error(chunks[-1])
    return completion_body(completion_id, body.model, chunks)


@router.post("/bench/chat/completions")
async def bench_chat_completions(request: Request, body: ChatCompletionRequest):
    """A non-streamed chat completion whose generation_stats (prompt and generation
    tokens/s, token counts, the runner's peak memory) are always filled: for benchmarks."""
    if body.stream:
        raise ApiError(400, "the bench endpoint answers in one piece; send stream: false", param="stream")
    return await chat_completions(request, body)
