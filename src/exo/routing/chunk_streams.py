"""Delivers ChunkGenerated messages from the chunks topic to the request that asked."""

import asyncio

from exo.routing.router import Router, Topic
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated


class ChunkStreams:
    def __init__(self, router: Router) -> None:
        self._chunks = router.subscribe(Topic.CHUNKS)
        self._streams: dict[CommandId, asyncio.Queue[ChunkGenerated]] = {}

    async def run(self) -> None:
        while True:
            chunk: ChunkGenerated = await self._chunks.get()
            queue = self._streams.get(chunk.command_id)
            if queue is not None:
                queue.put_nowait(chunk)

    def open(self, command_id: CommandId) -> asyncio.Queue[ChunkGenerated]:
        """Open before sending the command, so no chunk can arrive unclaimed."""
        queue: asyncio.Queue[ChunkGenerated] = asyncio.Queue()
        self._streams[command_id] = queue
        return queue

    def is_open(self, command_id: CommandId) -> bool:
        return command_id in self._streams

    def close(self, command_id: CommandId) -> None:
        self._streams.pop(command_id, None)
