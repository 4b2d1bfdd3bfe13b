"""Anthropic Claude Messages: /v1/messages and /v1/messages/count_tokens."""

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from exo.api.adapters.claude_messages import (
    ClaudeCountTokensRequest,
    ClaudeMessagesRequest,
    MessageEncoder,
    approximate_token_count,
    prompt_text,
    sse,
    to_task_params,
)
from exo.api.generation import generation_error, local_tokenizer, start_generation, stream_response
from exo.api.routers.cluster import card_or_404, node_of
from exo.shared.types.text_generation import ChunkGenerated

router = APIRouter(prefix="/v1/messages")


@router.post("")
async def create_message(request: Request, body: ClaudeMessagesRequest):
    generation = await start_generation(request, to_task_params(body), bool(body.stream))
    encoder = MessageEncoder(f"msg_{generation.command_id}", body.model)

    if body.stream:

        async def events(chunks: AsyncIterator[ChunkGenerated]) -> AsyncIterator[str]:
            async for chunk in chunks:
                for event in encoder.feed(chunk):
                    yield sse(event)

        return stream_response(generation, events)

    chunks = await generation.collect(request)
    if chunks[-1].finish_reason == "error":
        raise generation_error(chunks[-1])
    for chunk in chunks:
        encoder.feed(chunk)
    return encoder.body()


@router.post("/count_tokens")
def count_tokens(request: Request, body: ClaudeCountTokensRequest) -> dict[str, int]:
    card_or_404(node_of(request), body.model)
    text = prompt_text(body)
    # The model's own tokenizer when its files are on this node; it counts the messages'
    # text but not the few tokens the chat template adds around each message.
    tokenizer = local_tokenizer(request, body.model)
    if tokenizer is not None:
        return {"input_tokens": len(tokenizer.encode(text, add_special_tokens=False).ids)}
    return {"input_tokens": approximate_token_count(text)}
