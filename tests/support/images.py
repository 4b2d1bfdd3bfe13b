"""Test images (random noise PNGs, the same bytes for the same seed) and the tiny VLM."""

import io
from pathlib import Path

import numpy as np
from PIL import Image

from exo.devtools.tiny_vlms import make_tiny_vlm


def noise_png(seed: int, size: tuple[int, int] = (96, 96)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


# The tiny VLMs (devtools/tiny_vlms.py) by the model id tests serve them as.
VLM_MODELS = {
    "gemma4_vlm": "acme/gemma4-vlm-tiny",
    "gemma4_moe_vlm": "acme/gemma4-26b-vlm-tiny",
    "qwen2_5_vl": "acme/qwen2.5-vl-tiny",
    "qwen3_vl": "acme/qwen3-vl-tiny",
    "kimi_vl": "acme/kimi-vl-tiny",
}
VLM_QUESTION = "what is in the picture"


def vlm_models_dir(root: Path, names: tuple[str, ...] = tuple(VLM_MODELS)) -> Path:
    """A models dir under `root` holding the tiny VLMs `names`."""
    for name in names:
        make_tiny_vlm(root / VLM_MODELS[name].replace("/", "--"), name)
    return root
