"""Fewer, larger chunks from a fast engine. Each chunk costs a pickle down the runner's
pipe, a publish, a JSON encoding, an SSE write and the client's parse, on the cores the
engine decodes on (a small model on llama.cpp makes a hundred tokens a second or more).

- The runner holds a streaming request's token chunks for up to CHUNK_INTERVAL and
  sends them as one (`HeldChunks`); a request's first token, its last, prefill
  progress and errors go at once, so time to first token is untouched.
- The worker merges the chunks of one request that piled up in the pipe
  (`coalesced`): only what has already arrived."""

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChunkGenerated

# Seconds a streaming request's tokens may wait to go as one chunk (0: every token at once).
CHUNK_INTERVAL = float(os.environ.get("EXO_CHUNK_INTERVAL", "0.02"))


class HeldChunks:
    """Sends chunks through `send`, holding each streaming request's token chunks (after
    its first) until CHUNK_INTERVAL has passed since the oldest one held, then merged."""

    def __init__(self, send: Callable[[ChunkGenerated], None], interval: float = CHUNK_INTERVAL) -> None:
        self.send = send
        self.interval = interval
        self._streaming: set[CommandId] = set()
        # Per request: the chunk held (merged so far) and when its first part came.
        self._held: dict[CommandId, tuple[ChunkGenerated, float]] = {}

    def put(self, chunk: ChunkGenerated) -> None:
        command_id = chunk.command_id
        since = time.monotonic()
        held = self._held.pop(command_id, None)
        if held is not None:
            if _mergeable(held[0], chunk):
                chunk, since = _merged(held[0], chunk), held[1]
            else:
                self.send(held[0])
        holdable = chunk.finish_reason is None and chunk.prefill is None and self.interval > 0
        if holdable and command_id in self._streaming:
            self._held[command_id] = (chunk, since)
            return
        if chunk.finish_reason is not None:
            self._streaming.discard(command_id)
        elif chunk.token_ids:
            self._streaming.add(command_id)
        self.send(chunk)

    def flush(self, command_id: CommandId | None = None) -> None:
        """Sends what is held (of one request, or of all)."""
        for held_id in [command_id] if command_id is not None else list(self._held):
            held = self._held.pop(held_id, None)
            if held is not None:
                self.send(held[0])

    def tick(self) -> None:
        """Sends what has waited the interval."""
        now = time.monotonic()
        for command_id, (_, since) in list(self._held.items()):
            if now - since >= self.interval:
                self.flush(command_id)

    def forget(self, command_id: CommandId) -> None:
        """A cancelled request: what it had held goes first, then nothing more is held."""
        self.flush(command_id)
        self._streaming.discard(command_id)


def coalesced(messages: Iterable[Any]) -> Iterator[Any]:
    """`messages` in order, with each run of mergeable chunks of one request as one."""
    held: ChunkGenerated | None = None
    for message in messages:
        if isinstance(message, ChunkGenerated):
            if held is not None and _mergeable(held, message):
                held = _merged(held, message)
                continue
            if held is not None:
                yield held
            held = message
            continue
        if held is not None:
            yield held
            held = None
        yield message
    if held is not None:
        yield held


def _mergeable(first: ChunkGenerated, then: ChunkGenerated) -> bool:
    """Token chunks of one request, the first not its last; prefill progress and errors
    go on as they are."""
    return (
        first.command_id == then.command_id
        and first.finish_reason is None
        and first.prefill is None
        and then.prefill is None
        and (first.logprobs is None) == (then.logprobs is None)
    )


def _merged(first: ChunkGenerated, then: ChunkGenerated) -> ChunkGenerated:
    return then.model_copy(
        update={
            "text": first.text + then.text,
            "reasoning": first.reasoning + then.reasoning,
            "tool_calls": [*first.tool_calls, *then.tool_calls],
            "token_ids": [*first.token_ids, *then.token_ids],
            "logprobs": None if then.logprobs is None else [*(first.logprobs or []), *then.logprobs],
        }
    )
