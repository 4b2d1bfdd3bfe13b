"""Chunks that piled up in a runner's pipe go on as one: when the node falls behind a
fast engine (a small model on llama.cpp makes hundreds of tokens a second), each chunk
costs a publish, a JSON encoding and an SSE write, so several tokens of one request
waiting together are merged into one chunk. Nothing waits to be merged: only what has
already arrived."""

from collections.abc import Iterable, Iterator
from typing import Any

from exo.shared.types.text_generation import ChunkGenerated


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
