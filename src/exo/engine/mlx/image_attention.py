"""Gemma 4's bidirectional image attention (the 26B-A4B and 31B layouts, config
`use_bidirectional_attention: "vision"`): on the sliding-window layers a token of an
image also sees every later token of the same image (the window still bounds the past);
the full-attention layers stay causal, as transformers and vLLM apply it. (mlx-vlm 0.7.10 lays the overlay on the full
layers too, which is what puts it ~0.55 off in log-probability there.)

mlx-lm's language model attends causally, so its mask builder is wrapped: for a prefill
chunk whose request carries image spans (on its cache entries, `attach_image_spans`),
each sliding layer's causal window mask is widened by the same-image blocks. A later
token of an image must be in the same forward as the earlier ones, so such prompts are
prefilled in chunks that never cut an image's run (VisionPrompt.chunk_end)."""

from typing import Any

import mlx.core as mx
import numpy as np

_ATTRIBUTE = "exo_image_spans"


def install_image_overlay(inner: Any) -> None:
    """Wraps the Gemma 4 text model's per-layer mask builder."""
    build = inner._make_masks

    def masks(h: mx.array, cache: list[Any]) -> list[Any]:
        built = build(h, cache)
        sliding = [i for i, layer in enumerate(inner.layers) if _layer_type(layer) == "sliding_attention"]
        entry = next((cache[i] for i in sliding if i < len(cache) and cache[i] is not None), None)
        spans = getattr(entry, _ATTRIBUTE, None)
        if entry is None or not spans or h.shape[1] == 1:
            return built
        widened = _widened(entry, h.shape[1], inner.window_size, spans)
        return [widened if i in sliding else mask for i, mask in enumerate(built)]

    inner._make_masks = masks


def _layer_type(layer: Any) -> str:
    return getattr(getattr(layer, "layer", layer), "layer_type", "")


def _widened(entry: Any, length: int, window: int, spans: list[tuple[int, int]]) -> mx.array:
    """The sliding layer's causal window mask for `length` new tokens, widened to the
    later tokens of a query's own image."""
    causal = entry.make_mask(length, window_size=window, return_array=True)
    keys = causal.shape[-1]
    offset = int(entry.offset)
    query_positions = np.arange(offset, offset + length)
    # The keys are the last `keys` positions, ending with this chunk's.
    key_positions = np.arange(offset + length - keys, offset + length)
    query_image, key_image = _image_of(query_positions, spans), _image_of(key_positions, spans)
    same = (query_image[:, None] == key_image[None, :]) & (query_image[:, None] >= 0)
    # transformers' AND(window, OR(causal, same image)): the window still bounds the past,
    # so what the image adds is its later tokens.
    later = key_positions[None, :] > query_positions[:, None]
    return mx.logical_or(causal, mx.array(same & later))


def _image_of(positions: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Per position, the index of the image whose run holds it, else -1."""
    found = np.full(positions.shape, -1)
    for index, (start, end) in enumerate(spans):
        found[(positions >= start) & (positions < end)] = index
    return found


def attach_image_spans(cache: list[Any], spans: list[tuple[int, int]] | None) -> None:
    for entry in cache:
        if entry is not None:
            setattr(entry, _ATTRIBUTE, spans)
