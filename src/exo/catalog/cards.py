"""Making cards: the built-in ones from their TOML files, the others from a model's
config.json (read from a model dir, or fetched from the hub)."""

import functools
import json
import tomllib
from pathlib import Path

from pydantic import ValidationError

from exo.catalog.model_dirs import resource_dir, weight_files
from exo.shared.models.families import family_facts, has_tensor_strategy
from exo.shared.models.model_cards import ModelCard, ModelTask, StorageSize
from exo.shared.models.vision import is_vision_weight, vision_runs


def _load_card_file(path: Path) -> ModelCard:
    try:
        return ModelCard.model_validate(tomllib.loads(path.read_text()))
    except (tomllib.TOMLDecodeError, ValidationError) as error:
        raise ValueError(f"malformed model card {path}: {error}") from error


@functools.cache
def builtin_cards() -> dict[str, ModelCard]:
    """The cards shipped in exo/resources/model_cards, read once."""
    cards: dict[str, ModelCard] = {}
    for path in sorted(resource_dir("model_cards").glob("*.toml")):
        card = _load_card_file(path)
        if card.model_id in cards:
            raise ValueError(f"model card {path} repeats model_id {card.model_id}")
        cards[card.model_id] = card
    return cards


def _config_value(config: dict, key: str) -> int | None:
    # Multimodal configs (Gemma 4, Qwen-VL) keep the language model's numbers in text_config.
    if key in config:
        return config[key]
    return config.get("text_config", {}).get(key)


def kv_sharing_tail_start(config: dict) -> int | None:
    """The first layer whose keys and values a KV-shared layer reads (None without KV
    sharing): each shared layer reuses the last unshared layer of its own attention type."""
    text = config.get("text_config", config)
    n_layers, n_shared = text.get("num_hidden_layers"), text.get("num_kv_shared_layers") or 0
    if not n_layers or n_shared <= 0 or n_shared >= n_layers:
        return None
    layer_types = text.get("layer_types")
    if not layer_types or len(layer_types) != n_layers:
        # As mlx-lm fills them in: (pattern - 1) sliding layers, then one full layer.
        pattern = text.get("sliding_window_pattern") or 5
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    first_shared = n_layers - n_shared
    last_of_type = {kind: i for i, kind in enumerate(layer_types[:first_shared])}
    sources = [last_of_type[kind] for kind in set(layer_types[first_shared:]) if kind in last_of_type]
    return min(sources, default=None)


def card_from_config(config: dict, model_id: str, weight_bytes: int, vision_bytes: int = 0) -> ModelCard:
    """A card from a model's config.json and the size of its weights (on disk, or as the
    hub lists them; `vision_bytes` of them the vision side's); what the family table
    knows about its model_type fills the rest."""
    n_layers = _config_value(config, "num_hidden_layers")
    hidden_size = _config_value(config, "hidden_size")
    if n_layers is None or hidden_size is None:
        raise ValueError("config.json has no num_hidden_layers or hidden_size")
    # Configs without num_key_value_heads use plain multi-head attention.
    kv_heads = _config_value(config, "num_key_value_heads") or _config_value(config, "num_attention_heads")
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    bits = quantization.get("bits")
    capabilities = ["text", "vision"] if vision_runs(config) else ["text"]
    model_type = config.get("model_type", "")
    facts = family_facts(model_type)
    return ModelCard(
        model_id=model_id,
        n_layers=n_layers,
        hidden_size=hidden_size,
        num_key_value_heads=kv_heads,
        supports_tensor=has_tensor_strategy(model_type),
        tasks=[ModelTask.TextGeneration],
        family=model_type,
        quantization=f"{bits}bit" if bits else "",
        capabilities=capabilities,
        reasoning_dialect=facts.reasoning_dialect,
        context_length=_config_value(config, "max_position_embeddings"),
        storage_size=StorageSize(in_bytes=weight_bytes),
        vision_bytes=vision_bytes if vision_runs(config) else 0,
        pipeline_tail_start=kv_sharing_tail_start(config),
    )


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as file:
        header_length = int.from_bytes(file.read(8), "little")
        return json.loads(file.read(header_length))


def vision_weight_bytes(config: dict, files: list[Path]) -> int:
    """The bytes of the vision tower's and projector's tensors, from the files' headers."""
    if not vision_runs(config):
        return 0
    total = 0
    for path in (path for path in files if path.is_file()):
        for name, tensor in _safetensors_header(path).items():
            if name != "__metadata__" and is_vision_weight(config, name):
                start, end = tensor["data_offsets"]
                total += end - start
    return total


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be loaded, read from its header alone (8 bytes of
    length, a JSON table of tensors and their byte offsets), or None: a truncated
    download or copy is found here, not by three runners failing to load it."""
    size = path.stat().st_size
    try:
        with path.open("rb") as file:
            header_length = int.from_bytes(file.read(8), "little")
            if size < 8 + header_length:
                return f"{path.name} is truncated: its header wants {8 + header_length} bytes, the file has {size}"
            header = json.loads(file.read(header_length))
    except (OSError, ValueError) as error:
        return f"{path.name} is not a safetensors file ({error})"
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__" and isinstance(t, dict)]
    needed = 8 + header_length + max(ends, default=0)
    if size < needed:
        return f"{path.name} is truncated: it holds {size} of its {needed} bytes"
    return None


def model_dir_problem(model_dir: Path) -> str | None:
    """Why a complete-looking model dir cannot be served: a weight file cut short."""
    for path in sorted(model_dir.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            return problem
    return None


def card_from_model_dir(model_dir: Path, model_id: str) -> ModelCard:
    """A card derived from config.json alone, for models exo has no built-in card for."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{model_dir / 'config.json'} is not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{model_dir / 'config.json'} is not a JSON object")
    files = weight_files(model_dir) or []
    weight_bytes = sum(path.stat().st_size for path in files)
    try:
        vision_bytes = vision_weight_bytes(config, [path for path in files if path.suffix == ".safetensors"])
    except (OSError, ValueError, KeyError, TypeError):  # a broken header: model_dir_problem names it
        vision_bytes = 0
    try:
        return card_from_config(config, model_id, weight_bytes, vision_bytes)
    except ValueError as error:
        raise ValueError(f"{model_dir / 'config.json'}: {error}") from error
