"""Which models exo can show images to: the one fact cards, the catalog and the engine
all read, so a card says `vision` only where the engine runs the model's vision side."""

from typing import Any

# Config model_types whose vision tower, projector and processor exo wires to the
# language model (engine/mlx/vision.py).
VISION_MODEL_TYPES = frozenset({"gemma4", "qwen2_5_vl"})


def vision_runs(config: dict[str, Any]) -> bool:
    """Whether exo runs this config.json's vision side."""
    if config.get("model_type") not in VISION_MODEL_TYPES or not config.get("vision_config"):
        return False
    return config.get("image_token_id") is not None


def bidirectional_images(config: dict[str, Any]) -> bool:
    """Gemma 4's 26B-A4B and 31B layouts: image tokens attend to each other both ways on
    the sliding-window layers."""
    text = config.get("text_config") or {}
    return text.get("use_bidirectional_attention") == "vision"
