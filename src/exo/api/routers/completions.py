"""OpenAI legacy Completions: /v1/completions."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from exo.api.adapters.completions import CompletionEncoder, CompletionRequest, sse, to_task_params
from exo.api.generation import check_token_ids, generation_error, local_tokenizer, start_generation, stream_response
from exo.shared.types.text_generation import ChunkGenerated

router = APIRouter(prefix="/v1")


def prompt_text(request: Request, body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    tokenizer = local_tokenizer(request, body.model)
    check_token_ids(body.prompt, tokenizer)
    return tokenizer.decode(body.prompt) if tokenizer is not None else ""


@router.post("/completions")
async def create_completion(request: Request, body: CompletionRequest):
    text = prompt_text(request, body)
    generation = await start_generation(request, to_task_params(body, text), bool(body.stream))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    encoder = CompletionEncoder(f"cmpl-{generation.command_id}", body.model, text if body.echo else "", include_usage)

    if body.stream:

        async def events(chunks: AsyncIterator[ChunkGenerated]) -> AsyncIterator[str]:
            async for chunk in chunks:
                for event in encoder.feed(chunk):
                    yield sse(event)
            yield "data: [DONE]\n\n"

        return stream_response(generation, events)

    chunks = await generation.collect(request)
    if chunks[-1].finish_reason == "error":
        raise generation_error(chunks[-1])
    for chunk in chunks:
        encoder.feed(chunk)
    return encoder.body()
