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


VLM_MODEL_ID = "acme/gemma4-vlm-tiny"
VLM_QUESTION = "what is in the picture"


def vlm_models_dir(root: Path) -> Path:
    """A models dir under `root` holding the tiny Gemma 4 VLM as VLM_MODEL_ID."""
    make_tiny_vlm(root / VLM_MODEL_ID.replace("/", "--"), "gemma4_vlm")
    return root
