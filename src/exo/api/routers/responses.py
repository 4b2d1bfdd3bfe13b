"""OpenAI Responses: /v1/responses."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from exo.api.adapters.responses import ResponseEncoder, ResponsesRequest, sse, to_task_params
from exo.api.generation import generation_error, start_generation, stream_response
from exo.shared.types.text_generation import ChunkGenerated

router = APIRouter(prefix="/v1")


@router.post("/responses")
async def create_response(request: Request, body: ResponsesRequest):
    generation = await start_generation(request, to_task_params(body), bool(body.stream))
    encoder = ResponseEncoder(body, f"resp_{generation.command_id}")

    if body.stream:

        async def events(chunks: AsyncIterator[ChunkGenerated]) -> AsyncIterator[str]:
            for event in encoder.start():
                yield sse(event)
            async for chunk in chunks:
                for event in encoder.feed(chunk):
                    yield sse(event)

        return stream_response(generation, events)

    chunks = await generation.collect(request)
    if chunks[-1].finish_reason == "error":
        raise generation_error(chunks[-1])
    for chunk in chunks:
        encoder.feed(chunk)
    return encoder.response()
