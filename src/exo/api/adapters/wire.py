"""The shape every API's encoder has, and the three wire formats they use.

An encoder turns one request's chunks into its API's events: a stream sends
`start()`, then `feed(chunk)` for each chunk, each event through `wire`, then `closing`;
a non-streamed answer feeds every chunk and returns `body()`. The same pass serves both,
so the two can never disagree."""

import json
from typing import Any, ClassVar, Protocol

from exo.shared.types.text_generation import ChunkGenerated

Event = dict[str, Any]

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


class Encoder(Protocol):
    media_type: ClassVar[str] = SSE
    # Sent after the last event of a stream.
    closing: ClassVar[str] = ""

    def start(self) -> list[Event]:
        """Events before the first chunk."""
        return []

    def feed(self, chunk: ChunkGenerated) -> list[Event]: ...

    def wire(self, event: Event) -> str: ...

    def body(self) -> Event:
        """The whole answer, once every chunk was fed."""
        ...


def prefill_only(chunk: ChunkGenerated) -> bool:
    """A chunk that only reports prefill progress: streams answer it with a keep-alive
    (Claude's `ping`, an SSE comment elsewhere), so a long prefill is not silence."""
    return (
        chunk.prefill is not None
        and chunk.finish_reason is None
        and not (chunk.text or chunk.reasoning or chunk.tool_calls)
    )


def keep_alive_comment(chunk: ChunkGenerated) -> Event:
    assert chunk.prefill is not None
    return {"comment": f"prefill {chunk.prefill.processed_tokens}/{chunk.prefill.total_tokens}"}


def sse_comment(event: Event) -> str | None:
    """An SSE comment for a keep-alive event: SDKs ignore it, proxies see traffic."""
    return f": {event['comment']}\n\n" if "comment" in event else None


def sse_data(event: Event) -> str:
    """OpenAI's SSE: data lines only."""
    return f"data: {json.dumps(event)}\n\n"


def sse_typed(event: Event) -> str:
    """Anthropic's and the Responses API's SSE: the event's type names the SSE event."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def ndjson(event: Event) -> str:
    return json.dumps(event) + "\n"


OPENAI_DONE = "data: [DONE]\n\n"
