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
from dataclasses import dataclass

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
