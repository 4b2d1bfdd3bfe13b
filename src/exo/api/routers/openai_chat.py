"""OpenAI-compatible endpoints: /v1/models and /v1/chat/completions."""

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from exo.api.adapters.chat_completions import (
    ChatCompletionRequest,
    ChunkEncoder,
    completion_body,
    to_task_params,
)
from exo.api.errors import ApiError
from exo.api.routers.cluster import card_or_404, node_of
from exo.master.master import least_loaded_instance
from exo.shared.types.commands import TaskFinished, TextGeneration
from exo.shared.types.common import CommandId, ModelId, new_id
from exo.shared.types.text_generation import ChunkGenerated

if TYPE_CHECKING:
    from exo.node import Node

router = APIRouter(prefix="/v1")


@router.get("/models")
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


# A command can be lost while the cluster elects a new master; don't wait forever.
ACCEPT_TIMEOUT_SECONDS = 15.0


async def wait_until_accepted(
    node: "Node", command_id: CommandId, queue: asyncio.Queue[ChunkGenerated]
) -> list[ChunkGenerated]:
    """Until the master has made a task of the command, or answered with a chunk (which
    is returned, taken off the queue)."""
    first_chunk = asyncio.ensure_future(queue.get())
    task_created = asyncio.ensure_future(
        node.replica.wait_for(lambda s: any(t.command_id == command_id for t in s.tasks.values()), timeout=3600)
    )
    done, _ = await asyncio.wait({first_chunk, task_created}, timeout=ACCEPT_TIMEOUT_SECONDS, return_when=FIRST_COMPLETED)
    task_created.cancel()
    if first_chunk in done:
        return [first_chunk.result()]
    first_chunk.cancel()
    if not done:
        raise ApiError(
            503, "the cluster did not accept the request in time (is a master elected?); retry", code="not_accepted"
        )
    return []


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    node = node_of(request)
    card_or_404(node, body.model)
    if least_loaded_instance(node.replica.state, ModelId(body.model)) is None:
        raise ApiError(
            404,
            f"model '{body.model}' has no running instance; place it first (POST /place_instance)",
            code="model_not_loaded",
            param="model",
        )
    command = TextGeneration(params=to_task_params(body), origin_session=node.session_id)
    streams = request.app.state.chunk_streams
    queue = streams.open(command.command_id)
    node.send_command(command)
    completion_id = f"chatcmpl-{new_id()}"

    def finish() -> None:
        streams.close(command.command_id)
        node.send_command(TaskFinished(finished_command_id=command.command_id))

    try:
        early = await wait_until_accepted(node, command.command_id, queue)
    except BaseException:
        finish()
        raise

    if body.stream:
        encoder = ChunkEncoder(
            completion_id, body.model, bool(body.stream_options and body.stream_options.include_usage)
        )

        async def sse() -> AsyncIterator[str]:
            # `finally` also runs when the client disconnects, which stops generation.
            try:
                async for chunk in streams.until_finished(queue, early):
                    for line in encoder.encode(chunk):
                        yield line
                yield "data: [DONE]\n\n"
            finally:
                finish()

        return StreamingResponse(sse(), media_type="text/event-stream")

    chunks: list[ChunkGenerated] = []
    try:
        async for chunk in streams.until_finished(queue, early):
            chunks.append(chunk)
    finally:
        finish()
    if chunks[-1].finish_reason == "error":
        raise ApiError(500, chunks[-1].error_message or "generation failed", code="generation_failed")
    return completion_body(completion_id, body.model, chunks)
