"""A request's KV as MLX holds it, sent from a prefill engine to a decode engine
(engine/kv_handoff.py says how the two halves meet). Each layer's cache is mlx-lm's
own object, read and written through its `state` (what mlx-lm's save_prompt_cache
writes): a plain `KVCache` (or a `CacheList` of them, DSA's) travels as its keys and
values for the positions each prefill chunk added, every other cache (`RotatingKVCache`'s window, `ArraysCache`'s SSM state,
`CacheList`s, DeepSeek V4's compressed branches) as its whole state once prefill ends,
bounded by its window or its state's size whatever the prompt's length."""

import copy
import json
import struct
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList, KVCache

from exo.engine.kv_handoff import Handoff, LayerPart

_LENGTH = struct.Struct("<I")


def pack(tree: Any) -> bytes:
    """A cache's state (nested lists, tuples and dicts of arrays and scalars) as bytes:
    a JSON header with the structure, each array in it by dtype, shape and size, then
    the arrays' bytes in that order."""
    buffers: list[bytes] = []

    def describe(node: Any) -> Any:
        if isinstance(node, mx.array):
            data = np.asarray(node.view(mx.uint8)).tobytes()
            buffers.append(data)
            return {"array": [str(node.dtype).removeprefix("mlx.core."), list(node.shape), len(data)]}
        if isinstance(node, (list, tuple)):
            return {"list": [describe(item) for item in node]}
        if isinstance(node, dict):
            return {"dict": [[key, describe(value)] for key, value in node.items()]}
        return {"value": node}

    header = json.dumps(describe(tree)).encode()
    return _LENGTH.pack(len(header)) + header + b"".join(buffers)


def unpack(payload: bytes) -> Any:
    (length,) = _LENGTH.unpack_from(payload)
    offset = _LENGTH.size + length

    def build(node: dict[str, Any]) -> Any:
        nonlocal offset
        if "array" in node:
            dtype, shape, size = node["array"]
            raw = mx.array(np.frombuffer(payload, np.uint8, size, offset))
            offset += size
            return raw.view(getattr(mx, dtype)).reshape(shape)
        if "list" in node:
            return [build(item) for item in node["list"]]
        if "dict" in node:
            return {key: build(value) for key, value in node["dict"]}
        return node["value"]

    return build(json.loads(payload[_LENGTH.size : offset]))


def _whole_state(layer: Any) -> dict[str, Any]:
    """What a cache that is not plain KV is restored from: its state, and its meta_state
    where it has one (exo's own caches keep their offset there)."""
    meta = getattr(layer, "meta_state", None)
    return {"state": layer.state, "meta": meta}


def _restore(layer: Any, whole: dict[str, Any]) -> None:
    layer.state = whole["state"]
    if whole["meta"] is not None:
        layer.meta_state = whole["meta"]


def _cut_to(layer: Any, length: int, end: int) -> Any:
    """A layer's cache holding `length` positions, as it stood after `end` of them: a
    trimmed copy (only a trimmable entry of the prefix cache is found longer than the
    prefix it serves)."""
    if length == end:
        return layer
    copied = copy.deepcopy(layer)
    copied.trim(length - end)
    return copied


def _plain_caches(layer: Any) -> list[KVCache] | None:
    """The plain KV caches a layer is, which travel by positions: the layer itself, or
    every cache of a CacheList of them (DSA's attention and indexer keys); None for a
    layer that travels whole."""
    if type(layer) is KVCache:
        return [layer]
    caches = getattr(layer, "caches", None)
    if isinstance(layer, CacheList) and caches and all(type(c) is KVCache for c in caches):
        return list(caches)
    return None


def _positions(caches: list[KVCache], start: int, end: int) -> list[list[mx.array]]:
    """[keys, values] of each cache for positions [start, end)."""
    positions = []
    for cache in caches:
        keys, values = cache.keys, cache.values
        assert keys is not None and values is not None
        positions.append([keys[..., start:end, :], values[..., start:end, :]])
    return positions


class KvExporter:
    """The prefill side: after each prompt chunk, what it added to the request's cache,
    from the handoff's `skip` on, handed to `send` part by part."""

    def __init__(self, skip: int, send: Callable[[LayerPart], None]) -> None:
        self.sent_until = skip  # positions before this are sent (or held by the decode side)
        self.send = send
        self.bytes_sent = 0

    def chunk_done(self, cache: list[Any], end: int, last: bool) -> None:
        start = self.sent_until
        for index, layer in enumerate(cache):
            plain = _plain_caches(layer)
            if plain is not None and start < end:
                self._send(LayerPart(index, start, end, False, pack(_positions(plain, start, end))))
            elif last and plain is None:
                self._send(LayerPart(index, 0, end, True, pack(_whole_state(layer))))
        self.sent_until = max(start, end)

    def _send(self, part: LayerPart) -> None:
        self.bytes_sent += len(part.payload)
        self.send(part)


class KvAssembler:
    """The receiving side: the parts of one handoff, put together into a cache like the
    one prefill would have left here. `fresh` is a new cache for the model, `held` a
    cache of this side's prefix cache holding the first `handoff.skip` positions (or
    more, when it can be trimmed), and how many it holds (None when skip is 0)."""

    def __init__(self, handoff: Handoff, fresh: list[Any], held: tuple[list[Any], int] | None) -> None:
        self.handoff = handoff
        self.cache = fresh
        self.bytes_received = 0
        self._held = held
        # Per plain layer: its chunks of positions, each [keys, values] per cache of it.
        self._chunks: dict[int, list[list[list[mx.array]]]] = {}
        self._whole: set[int] = set()
        for index, layer in enumerate(fresh):
            if _plain_caches(layer) is None:
                continue
            self._chunks[index] = []
            if handoff.skip > 0:
                assert held is not None
                kept = _plain_caches(held[0][index])
                assert kept is not None
                self._chunks[index].append(_positions(kept, 0, handoff.skip))

    def held_parts(self, start: int) -> list[LayerPart]:
        """Positions [start, skip) of the held prefix, as a prefill side lacking them is
        sent them: plain layers by positions, every other layer whole, as it stood after
        position skip."""
        skip = self.handoff.skip
        if self._held is None or start >= skip:
            return []
        held, length = self._held
        parts: list[LayerPart] = []
        for index, layer in enumerate(held):
            plain = _plain_caches(layer)
            if plain is not None:
                parts.append(LayerPart(index, start, skip, False, pack(_positions(plain, start, skip))))
            else:
                parts.append(LayerPart(index, 0, skip, True, pack(_whole_state(_cut_to(layer, length, skip)))))
        return parts

    @property
    def length(self) -> int:
        """Positions of the prompt the KV holds once every part is in."""
        return len(self.handoff.prompt) - 1

    def add(self, part: LayerPart) -> None:
        self.bytes_received += len(part.payload)
        state = unpack(part.payload)
        if part.whole:
            _restore(self.cache[part.layer], state)
            self._whole.add(part.layer)
            return
        chunks = self._chunks[part.layer]
        have = sum(chunk[0][0].shape[2] for chunk in chunks)
        if part.start != have:
            raise ValueError(f"layer {part.layer}: positions from {part.start} came after {have}")
        chunks.append(state)

    def finish(self) -> list[Any]:
        """The assembled cache; raises ValueError when a part is missing."""
        for index, layer in enumerate(self.cache):
            plain = _plain_caches(layer)
            if plain is None:
                if index not in self._whole:
                    raise ValueError(f"layer {index}'s state never came")
                continue
            chunks = self._chunks[index]
            for which, cache in enumerate(plain):
                keys = mx.concatenate([chunk[which][0] for chunk in chunks], axis=2) if chunks else None
                values = mx.concatenate([chunk[which][1] for chunk in chunks], axis=2) if chunks else None
                held = 0 if keys is None else keys.shape[2]
                if held != self.length:
                    raise ValueError(f"layer {index} holds {held} positions of {self.length}")
                cache.state = (keys, values, held)
        mx.eval([layer.state for layer in self.cache])
        return self.cache
