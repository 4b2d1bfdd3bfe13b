"""Disaggregated serving, the engine-neutral half: a request prefilled by one engine and
decoded by another. The decode side asks for a `Handoff` (the prompt's tokens, and how
many leading ones its own prefix cache already holds, which are not sent); the prefill
side feeds the prompt but its last token and sends the KV as `LayerPart`s, a layer's
new positions after each prefill chunk (so the decode side receives while prefill goes
on) and, at the end, the whole state of layers that are not a concatenation of positions
(a sliding window, an SSM state); the decode side assembles them and feeds the last
token itself, so sampling happens in one place and greedy text is a single engine's.

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


@runtime_checkable
class HandoffEngine(Protocol):
    """What an engine that hands KV over does, on either side."""

    def handoff_of(self, params: TextGenerationTaskParams, min_tokens: int) -> Handoff | None:
        """The decode side: what to ask for before submitting `params` (None: prefill here)."""
        ...

    def kv_assembler(self, handoff: Handoff) -> PartSink: ...

    def import_kv(self, request_id: CommandId, sink: PartSink, stats: KvHandoffStats) -> None:
        """The assembled KV where `request_id`'s admission finds it; submit it next."""
        ...

    def submit_prefill(self, request_id: CommandId, handoff: Handoff, send: Callable[[LayerPart], None]) -> None:
        """The prefill side: feed the handoff's prompt but its last token, each part to `send`."""
        ...

    def cancel(self, request_id: CommandId) -> None:
        """Stop a request, a prefill for another engine included."""
        ...
