"""Which models exo can show images to: the one fact cards, the catalog and the engine
all read, so a card says `vision` only where the engine runs the model's vision side."""

import json
import math
from pathlib import Path
from typing import Any, cast

# Config model_types whose vision tower, projector and processor exo wires to the
# language model (engine/mlx/vision.py).
VISION_MODEL_TYPES = frozenset({"gemma4", "qwen2_5_vl", "qwen3_vl", "kimi_vl"})


# Where a checkpoint keeps the vision side's weights: as transformers saves it
# ("model."-prefixed), as older or mlx-vlm-converted checkpoints write it.
TOWER_PREFIXES = {
    "gemma4": ("model.vision_tower.", "vision_tower."),
    "qwen2_5_vl": ("model.visual.", "visual.", "vision_tower."),
    "qwen3_vl": ("model.visual.", "visual.", "vision_tower."),
    "kimi_vl": ("vision_tower.",),
}
PROJECTOR_PREFIXES = {
    "gemma4": ("model.embed_vision.", "embed_vision."),
    "kimi_vl": ("multi_modal_projector.",),
}


def is_vision_weight(config: dict[str, Any], name: str) -> bool:
    """Whether a weight of this config's checkpoint belongs to its vision tower or projector."""
    model_type = config.get("model_type", "")
    prefixes = TOWER_PREFIXES.get(model_type, ()) + PROJECTOR_PREFIXES.get(model_type, ())
    return name.startswith(prefixes)


def image_token_id(config: dict[str, Any]) -> int | None:
    """The token the processor repeats once per soft token of an image (Kimi-VL's
    config calls it the media placeholder)."""
    found = config.get("image_token_id", config.get("media_placeholder_token_id"))
    return None if found is None else int(found)


def vision_runs(config: dict[str, Any]) -> bool:
    """Whether exo runs this config.json's vision side."""
    if config.get("model_type") not in VISION_MODEL_TYPES or not config.get("vision_config"):
        return False
    return image_token_id(config) is not None


def moonvit_fields(vision: dict[str, Any]) -> dict[str, Any]:
    """Kimi-VL's tower config as mlx-vlm's VisionConfig names it (depth, num_heads,
    embed_dim where the hub's configs say num_hidden_layers, num_attention_heads,
    hidden_size; its defaults are the real tower's sizes, so a config read as is would
    build a 27-block tower whatever it says)."""
    renamed = {"num_hidden_layers": "depth", "num_attention_heads": "num_heads", "hidden_size": "embed_dim"}
    return {**vision, **{new: vision[old] for old, new in renamed.items() if old in vision and new not in vision}}


def bidirectional_images(config: dict[str, Any]) -> bool:
    """Gemma 4's 26B-A4B and 31B layouts: image tokens attend to each other both ways on
    the sliding-window layers."""
    text = config.get("text_config") or {}
    return text.get("use_bidirectional_attention") == "vision"


def image_prompt_tokens(config: dict[str, Any], processor: dict[str, Any], width: int, height: int) -> int:
    """The tokens an image of this size takes in the prompt, its begin and end markers
    included, as the family's processor sizes it (so the API can count a prompt before
    the engine builds it). 1 for a family it does not know."""
    model_type = config.get("model_type")
    if model_type == "gemma4":
        patch = int(processor.get("patch_size", 16))
        pool = int(processor.get("pooling_kernel_size", 3))
        budget = int(processor.get("max_soft_tokens", 280))
        rows, columns = _gemma4_size(height, width, patch, budget * pool**2, pool)
        return (rows // patch) * (columns // patch) // pool**2 + 2
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        patch = int(processor.get("patch_size", 14))
        merge = int(processor.get("merge_size", 2))
        size = processor.get("size") or {}
        low = int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        high = int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        rows, columns = _qwen_size(height, width, patch * merge, low, high)
        return (rows // patch) * (columns // patch) // merge**2
    if model_type == "kimi_vl":
        patch = int(processor.get("patch_size", 14))
        merge = [int(n) for n in processor.get("merge_kernel_size") or (2, 2)]
        limit = int(processor.get("in_token_limit", 4096))
        rows, columns = _kimi_size(
            height, width, patch, limit, [n * patch for n in merge], bool(processor.get("pad_input"))
        )
        return (rows // patch // merge[0]) * (columns // patch // merge[1])
    return 1


def _kimi_size(height: int, width: int, patch: int, limit: int, steps: list[int], pad: bool) -> tuple[int, int]:
    """Kimi-VL's resize: down (keeping the aspect) to within `limit` patches, then padded
    up (pad_input) or cropped down to whole merged patches of `steps` pixels."""
    patches = (width // patch) * (height // patch)
    if patches > limit:
        scale = math.sqrt(limit / patches)
        height, width = int(height * scale), int(width * scale)
    if pad:
        return -(-height // steps[0]) * steps[0], -(-width // steps[1]) * steps[1]
    return height - height % steps[0], width - width % steps[1]


def _gemma4_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple[int, int]:
    """Gemma 4's aspect-preserving resize: the largest size within the patch budget whose
    sides are multiples of pool * patch."""
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    side = pool * patch
    rows = math.floor(factor * height / side) * side
    columns = math.floor(factor * width / side) * side
    longest = (max_patches // pool**2) * side
    if rows == 0:
        rows, columns = side, min(math.floor(width / height) * side, longest)
    elif columns == 0:
        rows, columns = min(math.floor(height / width) * side, longest), side
    return rows, columns


def _qwen_size(height: int, width: int, factor: int, low: int, high: int) -> tuple[int, int]:
    """Qwen2-VL's smart resize: sides multiples of `factor`, pixels within [low, high]."""
    rows, columns = round(height / factor) * factor, round(width / factor) * factor
    if rows * columns > high:
        beta = math.sqrt(height * width / high)
        rows = max(factor, math.floor(height / beta / factor) * factor)
        columns = max(factor, math.floor(width / beta / factor) * factor)
    elif rows * columns < low:
        beta = math.sqrt(low / (height * width))
        rows, columns = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return rows, columns


def processor_chat_template(model_dir: Path) -> str | None:
    """The chat template of the model dir's processor where it has one apart from the
    tokenizer's, as transformers' ProcessorMixin reads it: processor_config.json's, else
    the legacy chat_template.json's (chat_template.jinja is the tokenizer's as well). A
    VLM's prompts are its processor's: a checkpoint whose processor template writes an
    image otherwise than the tokenizer's would get another prompt."""
    for name in ("processor_config.json", "chat_template.json"):
        path = model_dir / name
        if not path.exists():
            continue
        template = json.loads(path.read_text()).get("chat_template")
        if isinstance(template, dict):
            template = cast(dict[str, Any], template).get("default")
        if isinstance(template, str):
            return template
    return None


def image_processor_fields(model_dir: Path) -> dict[str, Any] | None:
    """The image processor's config as transformers' processor reads it: nested in
    processor_config.json where it is there (the hub's Gemma 4 checkpoints ship no
    preprocessor_config.json), else preprocessor_config.json; None without either."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            fields = json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if name == "processor_config.json":
            fields = fields.get("image_processor")
        if isinstance(fields, dict):
            return cast(dict[str, Any], fields)
    return None
