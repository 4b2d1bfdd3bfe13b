"""Qwen3-VL's DeepStack on mlx-lm's Qwen3 language model, which has none: the vision
tower's early blocks each give features of their own (one per image token), and after
decoder layer i (for i below their count) the i-th of them is added to the hidden states
at the image's positions, as transformers' Qwen3VLTextModel does.

A request's features ride on its KV cache entries (`attach_deepstack`), as its 3-D
positions do (engine/mlx/mrope.py); each such layer reads them from the cache it is
given, for the positions it is about to compute. Every layer knows its index in the
whole model, so on a pipeline the rank holding layer i adds level i (the features reach
every rank with the expanded prompt, engine/mlx/vision.py's share_prompt)."""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

_ATTRIBUTE = "exo_deepstack"


@dataclass
class DeepStackRun:
    start: int
    features: mx.array  # (levels, tokens, hidden)


@dataclass
class DeepStack:
    runs: list[DeepStackRun]

    def addition(self, level: int, offset: int, length: int) -> mx.array | None:
        """What level `level` adds to positions [offset, offset + length), or None where
        no image run overlaps them."""
        pieces: list[mx.array] = []
        at = offset
        for run in self.runs:
            lo, hi = max(run.start, offset), min(run.start + run.features.shape[1], offset + length)
            if lo >= hi:
                continue
            hidden = run.features.shape[2]
            pieces.append(mx.zeros((lo - at, hidden), dtype=run.features.dtype))
            pieces.append(run.features[level, lo - run.start : hi - run.start])
            at = hi
        if not pieces:
            return None
        pieces.append(mx.zeros((offset + length - at, pieces[-1].shape[1]), dtype=pieces[-1].dtype))
        return mx.concatenate(pieces)


def install_deepstack(inner: Any, first_layer: int, levels: int) -> None:
    """Gives the decoder layers this rank holds among the first `levels` their DeepStack
    addition; `first_layer` is the index of this rank's first layer in the model."""
    for local, layer in enumerate(inner.layers):
        level = first_layer + local
        if level >= levels:
            continue
        block = getattr(layer, "layer", layer)
        block.exo_deepstack_level = level
        block.__class__ = _stacked(type(block))


_STACKED: dict[type, type] = {}


def _stacked(cls: type) -> type:
    """`cls` whose output gains its level's DeepStack features from the cache it is given."""
    if cls in _STACKED:
        return _STACKED[cls]

    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        stack: DeepStack | None = getattr(cache, _ATTRIBUTE, None)
        offset = int(cache.offset) if cache is not None else 0
        out = cls.__call__(self, x, mask, cache)
        addition = None if stack is None else stack.addition(self.exo_deepstack_level, offset, x.shape[1])
        return out if addition is None else out + addition[None].astype(out.dtype)

    _STACKED[cls] = type(f"DeepStacked{cls.__name__}", (cls,), {"__call__": __call__})
    return _STACKED[cls]


def attach_deepstack(cache: list[Any], stack: DeepStack | None) -> None:
    """The request's DeepStack features on each of its cache entries (None clears what a
    cache taken from the prefix cache may still carry)."""
    for entry in cache:
        setattr(entry, _ATTRIBUTE, stack)
