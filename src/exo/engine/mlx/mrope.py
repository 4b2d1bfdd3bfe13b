"""The Qwen-VL family's 3-D rotary positions (M-RoPE) on mlx-lm's language models
(Qwen2 for Qwen2.5-VL, Qwen3 for Qwen3-VL), which rotate by the plain 1-D position.
Each rotary frequency follows one axis: in contiguous sections (Qwen2.5-VL: time, then
height, then width) or interleaved (Qwen3-VL: t, h, w, t, h, w, ..., time the tail).

An image's tokens take (time, row, column) positions starting where the image starts,
and the text after it resumes at one past the largest of them, so from there on every
position is the token's index plus a fixed delta (negative). Text tokens have the same
position on all three axes, where M-RoPE is exactly the plain rotation.

A request's positions ride on its KV cache entries (`attach_positions`); each attention
layer reads them from the cache it is given, for the offsets it is about to rotate. A
cache without them (every text-only request, the decode batch) rotates as before."""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_ATTRIBUTE = "exo_rope_positions"


class RopePositions:
    """A prompt's positions, (3, prompt length), and the delta for every later token."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.delta = int(table.max()) + 1 - table.shape[1] if table.size else 0

    def window(self, offset: int, length: int) -> mx.array:
        index = np.arange(offset, offset + length)
        inside = np.minimum(index, self.table.shape[1] - 1)
        rows = np.where(index < self.table.shape[1], self.table[:, inside], index + self.delta)
        return mx.array(rows.astype(np.float32))


def image_positions(start: int, rows: int, columns: int) -> np.ndarray:
    """One image's (time, row, column) positions, from `start`, row by row."""
    row, column = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
    return np.stack([np.zeros(rows * columns, dtype=np.int64), row.ravel(), column.ravel()]) + start


def frequency_axes(sections: list[int], interleaved: bool) -> np.ndarray:
    """The axis (0 time, 1 height, 2 width) each rotary frequency follows, as
    transformers assigns them."""
    count = sum(sections)
    if not interleaved:
        return np.repeat(np.arange(3), sections)
    axes = np.zeros(count, dtype=np.int64)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


class _Spec:
    def __init__(self, head_dim: int, theta: float, sections: list[int], interleaved: bool) -> None:
        self.inv_freq = mx.array((1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))
        axes = frequency_axes(sections, interleaved)
        # One-hot per axis: picking each frequency's axis is a masked sum, exact in float.
        self.pick = mx.array((axes[None, :] == np.arange(3)[:, None]).astype(np.float32))[:, None, :]
        self.positions: mx.array | None = None


class MRope(nn.Module):
    """The layer's rotation, by 3-D positions when its attention sets them."""

    def __init__(self, base: Any, spec: _Spec) -> None:
        super().__init__()
        self.base = base
        # Plain attributes, not module state: nothing here is a parameter.
        self.spec = spec

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        positions = self.spec.positions
        if positions is None:
            return self.base(x, offset=offset)
        freqs = positions[:, :, None] * self.spec.inv_freq[None, None, :]
        chosen = (freqs * self.spec.pick).sum(axis=0)
        angles = mx.concatenate([chosen, chosen], axis=-1)
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * mx.cos(angles) + rotated * mx.sin(angles)).astype(x.dtype)


def install_mrope(inner: Any, text_config: dict[str, Any]) -> bool:
    """Gives every attention layer of a Qwen-VL language model M-RoPE; False for a
    model without mrope sections."""
    scaling = text_config.get("rope_scaling") or text_config.get("rope_parameters") or {}
    sections = scaling.get("mrope_section")
    if not sections:
        return False
    theta = float(text_config.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
    head_dim = int(
        text_config.get("head_dim") or int(text_config["hidden_size"]) // int(text_config["num_attention_heads"])
    )
    interleaved = bool(scaling.get("mrope_interleaved"))
    for layer in inner.layers:
        attention = getattr(layer, "layer", layer).self_attn
        attention.rope = MRope(attention.rope, _Spec(head_dim, theta, list(sections), interleaved))
        attention.__class__ = _positioned(type(attention))
    return True


_POSITIONED: dict[type, type] = {}


def _positioned(cls: type) -> type:
    """`cls` whose call first sets its rope's positions from the cache it is given."""
    if cls in _POSITIONED:
        return _POSITIONED[cls]

    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        positions: RopePositions | None = getattr(cache, _ATTRIBUTE, None)
        spec = self.rope.spec
        spec.positions = None if positions is None else positions.window(int(cache.offset), x.shape[1])
        try:
            return cls.__call__(self, x, mask, cache)
        finally:
            spec.positions = None

    _POSITIONED[cls] = type(f"Positioned{cls.__name__}", (cls,), {"__call__": __call__})
    return _POSITIONED[cls]


def attach_positions(cache: list[Any], positions: RopePositions | None) -> None:
    """The request's positions on each of its cache entries (None clears what a cache
    taken from the prefix cache may still carry)."""
    for entry in cache:
        setattr(entry, _ATTRIBUTE, positions)
