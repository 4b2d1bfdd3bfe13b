"""Disaggregated serving, the engine-neutral half: a request prefilled by one engine and
decoded by another. The decode side asks for a `Handoff` (the prompt's tokens, and how
many leading ones its own prefix cache already holds, which are not sent). The prefill
side, where its own prefix cache lacks some of those, is offered them first
(`offer_wanted`: they come as parts the other way, so a prefix cached on either side is
never prefilled again). It feeds the prompt but its last token and sends the KV as
`LayerPart`s, a layer's new positions after each prefill chunk (so the decode side
receives while prefill goes on) and, at the end, the whole state of layers that are not
a concatenation of positions (a sliding window, an SSM state); the decode side assembles
them and feeds the last token itself, so sampling happens in one place and greedy text
is a single engine's.

What a part's payload holds is the engine's (engine/mlx/kv_transfer.py); here it is
bytes, framed for a stream."""

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import KvHandoffStats, TextGenerationTaskParams

# layer, start, end, whole, payload length
_HEADER = struct.Struct("<IQQ?Q")


@dataclass(frozen=True)
class Handoff:
    """What the decode side asks the prefill side for: the KV of `prompt[:-1]`, without
    its first `skip` positions (the decode side's prefix cache holds them)."""

    prompt: list[int]
    skip: int

    @property
    def sent_tokens(self) -> int:
        return len(self.prompt) - 1 - self.skip


@dataclass(frozen=True)
class LayerPart:
    """One layer's KV for positions [start, end), or, when `whole`, the layer's whole
    state after position `end`."""

    layer: int
    start: int
    end: int
    whole: bool
    payload: bytes

    def framed(self) -> bytes:
        return _HEADER.pack(self.layer, self.start, self.end, self.whole, len(self.payload)) + self.payload


HEADER_BYTES = _HEADER.size


def part_header(header: bytes) -> tuple[int, int, int, bool, int]:
    """(layer, start, end, whole, payload length) of a framed part's first HEADER_BYTES."""
    layer, start, end, whole, length = _HEADER.unpack(header)
    return layer, start, end, whole, length


class PartSink(Protocol):
    """Where a handoff's parts go on the decode side, as they arrive."""

    bytes_received: int

    def add(self, part: LayerPart) -> None: ...

    def held_parts(self, start: int) -> list[LayerPart]:
        """The positions [start, skip) of the prefix this side holds, as parts (what a
        prefill side lacking them is offered)."""
        ...


@runtime_checkable
class HandoffEngine(Protocol):
    """What an engine that hands KV over does, on either side."""

    def cached_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` this engine's prefix cache holds the KV of."""
        ...

    def handoff_of(self, params: TextGenerationTaskParams, min_tokens: int) -> Handoff | None:
        """The decode side: what to ask for before submitting `params` (None: prefill here)."""
        ...

    def kv_assembler(self, handoff: Handoff) -> PartSink: ...

    def import_kv(self, request_id: CommandId, sink: PartSink, stats: KvHandoffStats | None = None) -> None:
        """The assembled KV where `request_id`'s admission finds it (submit it next): in
        the prefix cache."""
        ...

    def submit_prefill(self, request_id: CommandId, handoff: Handoff, send: Callable[[LayerPart], None]) -> None:
        """The prefill side: feed the handoff's prompt but its last token, each part to `send`."""
        ...

    def cancel(self, request_id: CommandId) -> None:
        """Stop a request, a prefill for another engine included."""
        ...


def offer_wanted(engine: HandoffEngine, handoff: Handoff) -> Handoff | None:
    """The prefill side: what to receive of the decode side's cached prefix before
    prefilling `handoff`, as a handoff of its own (its prompt that prefix and one token
    more, its skip what this engine's prefix cache already holds of it); None when this
    engine holds all of it."""
    if handoff.skip == 0:
        return None
    held = engine.cached_prefix(handoff.prompt[: handoff.skip])
    return Handoff(handoff.prompt[: handoff.skip + 1], held) if held < handoff.skip else None
