"""How many prompt tokens an image takes, counted by the API before the engine runs the
processor (shared/models/vision.py), equals what transformers' own image processors
give (the PIL ones), for Gemma 4, Qwen2.5-VL and Qwen3-VL, and what mlx-vlm's gives
for Kimi-VL, across shapes and sizes."""

import numpy as np
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from exo.shared.models.vision import image_prompt_tokens

SIZES = [(96, 96), (200, 50), (37, 300), (1000, 800), (13, 13), (640, 480)]
GEMMA4 = {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 280}
GEMMA4_TINY = {"patch_size": 4, "pooling_kernel_size": 3, "max_soft_tokens": 70}
QWEN = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
}
# Qwen3-VL's processor configs give the pixel bounds as `size`.
QWEN3 = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
QWEN_TINY = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 16 * 16, "max_pixels": 128 * 128}


def _image(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8))


def test_gemma4_counts_match_transformers() -> None:
    for processor in (GEMMA4, GEMMA4_TINY):
        reference = Gemma4ImageProcessorPil(**processor)
        for width, height in SIZES:
            soft = int(reference(images=[_image(width, height)], return_tensors="np")["num_soft_tokens_per_image"][0])
            # Its soft tokens between the begin and end markers.
            assert image_prompt_tokens({"model_type": "gemma4"}, processor, width, height) == soft + 2, (width, height)


def test_qwen_vl_counts_match_transformers() -> None:
    for model_type, processor in (("qwen2_5_vl", QWEN), ("qwen2_5_vl", QWEN_TINY), ("qwen3_vl", QWEN3)):
        reference = Qwen2VLImageProcessorPil(**processor)
        for width, height in SIZES:
            grid = reference(images=[_image(width, height)], return_tensors="np")["image_grid_thw"][0]
            merged = int(np.prod(grid)) // processor["merge_size"] ** 2
            assert image_prompt_tokens({"model_type": model_type}, processor, width, height) == merged, (width, height)


# Kimi-VL's real processor config (pad_input, 4096 patches of 14), the tiny one's, and one
# that crops instead of padding, with a limit small enough that most sizes are resized.
KIMI = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_token_limit": 4096, "pad_input": True}
KIMI_TINY = {"patch_size": 4, "merge_kernel_size": [2, 2], "in_token_limit": 1024, "pad_input": True}
KIMI_CROP = {"patch_size": 4, "merge_kernel_size": [2, 2], "in_token_limit": 300, "pad_input": False}


def test_kimi_vl_counts_match_mlx_vlm() -> None:
    """transformers has no Kimi-VL image processor; mlx-vlm's (torch-free) is the one exo
    serves with."""
    from mlx_vlm.models.kimi_vl.processing_kimi_vl import KimiVLImageProcessor

    for processor in (KIMI, KIMI_TINY, KIMI_CROP):
        reference = KimiVLImageProcessor(**processor)
        for width, height in [*SIZES, (3000, 2000)]:
            rows, columns = (int(n) for n in reference(images=[_image(width, height)])["image_grid_hws"][0].tolist())
            merged = (rows // 2) * (columns // 2)
            assert image_prompt_tokens({"model_type": "kimi_vl"}, processor, width, height) == merged, (width, height)
