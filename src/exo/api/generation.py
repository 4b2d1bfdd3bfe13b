"""The one flow every generation endpoint shares: send a TextGeneration command, wait
until the master accepts it, stream its chunks, and finish the task when the stream ends
or the client leaves (which is also how generation is cancelled)."""

import asyncio
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from exo.api.errors import ApiError
from exo.api.routers.cluster import card_or_404, node_of
from exo.master.master import least_loaded_instance
from exo.shared.models.model_cards import find_local_model_dir
from exo.shared.types.commands import TaskFinished, TextGeneration
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChunkGenerated, TextGenerationTaskParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from exo.api.chunk_streams import ChunkStreams
    from exo.node import Node

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
    done, _ = await asyncio.wait(
        {first_chunk, task_created}, timeout=ACCEPT_TIMEOUT_SECONDS, return_when=FIRST_COMPLETED
    )
    task_created.cancel()
    if first_chunk in done:
        return [first_chunk.result()]
    first_chunk.cancel()
    if not done:
        raise ApiError(
            503, "the cluster did not accept the request in time (is a master elected?); retry", code="not_accepted"
        )
    return []


def require_instance(request: Request, model: str) -> None:
    """A 404 (in the calling API's error shape) for an unknown model or one not placed."""
    node = node_of(request)
    card_or_404(node, model)
    if least_loaded_instance(node.replica.state, ModelId(model)) is None:
        raise ApiError(
            404,
            f"model '{model}' has no running instance; place it first (POST /place_instance)",
            code="model_not_loaded",
            param="model",
        )


class Generation:
    """One accepted TextGeneration command and its chunk stream."""

    def __init__(self, node: "Node", streams: "ChunkStreams", command_id: CommandId) -> None:
        self.node = node
        self.streams = streams
        self.command_id = command_id
        self.queue = streams.open(command_id)
        self.early: list[ChunkGenerated] = []
        self._finished = False

    def chunks(self) -> AsyncIterator[ChunkGenerated]:
        return self.streams.until_finished(self.queue, self.early)

    def finish(self) -> None:
        """Idempotent; the master drops the task, which stops generation if it still runs."""
        if self._finished:
            return
        self._finished = True
        self.streams.close(self.command_id)
        self.node.send_command(TaskFinished(finished_command_id=self.command_id))

    async def collect(self) -> list[ChunkGenerated]:
        try:
            return [chunk async for chunk in self.chunks()]
        finally:
            self.finish()


async def start_generation(request: Request, params: TextGenerationTaskParams) -> Generation:
    require_instance(request, params.model)
    node = node_of(request)
    command = TextGeneration(params=params, origin_session=node.session_id)
    generation = Generation(node, request.app.state.chunk_streams, command.command_id)
    node.send_command(command)
    try:
        generation.early = await wait_until_accepted(node, command.command_id, generation.queue)
    except BaseException:
        generation.finish()
        raise
    return generation


def stream_response(
    generation: Generation,
    encode: Callable[[AsyncIterator[ChunkGenerated]], AsyncIterator[str]],
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Streams encode(chunks); `finally` also runs when the client disconnects, and
    finishing the task then is what cancels the generation."""

    async def body() -> AsyncIterator[str]:
        try:
            async for line in encode(generation.chunks()):
                yield line
        finally:
            generation.finish()

    return StreamingResponse(body(), media_type=media_type)


@lru_cache(maxsize=8)
def _tokenizer_at(path: Path) -> "Tokenizer | None":
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # missing or unreadable: callers fall back to an estimate
        return None


def local_tokenizer(request: Request, model: str) -> "Tokenizer | None":
    """The model's fast tokenizer when its files are on this node (the API process never
    loads the model itself), else None."""
    node = node_of(request)
    if model not in node.cards():
        return None
    model_dir = find_local_model_dir(model, node.config.exo_home)
    return _tokenizer_at(model_dir) if model_dir is not None else None
