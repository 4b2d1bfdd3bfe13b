"""Model cards: what exo knows about a model before loading it, and where local models live.

Built-in cards ship as TOML files in `exo/resources/model_cards`. Any complete model
directory in a models dir (`<dir>/<org>--<name>/`, Hugging Face layout) also gets a card,
derived from its config.json, so local models show up without any network call.
"""

import functools
import importlib.util
import json
import os
import tomllib
from enum import StrEnum
from importlib.resources import files
from pathlib import Path

from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ReasoningDialect(StrEnum):
    """What happens to an assistant message's reasoning when a later request sends it back.

    - none: the model has no reasoning channel.
    - post_last_user: reasoning only matters for the turn after the last user message;
      reasoning on older assistant turns is dropped.
    - suffix: reasoning is carried inside the assistant content itself, so sending the
      content back is enough; no separate reasoning round-trip.
    - channel: reasoning lives on its own channel (e.g. Harmony) and is sent back
      verbatim on every turn.
    - tool_conditional: reasoning is always kept when the conversation has tools, because
      the model chains tool calls on its earlier reasoning (DeepSeek V3.2 / V4).
    """

    none = "none"
    post_last_user = "post_last_user"
    suffix = "suffix"
    channel = "channel"
    tool_conditional = "tool_conditional"


class ModelTask(StrEnum):
    TextGeneration = "TextGeneration"
    ImageGeneration = "ImageGeneration"
    ImageEdits = "ImageEdits"


class FrozenModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageSize(FrozenModel):
    in_bytes: int


class SamplingDefaults(FrozenModel):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # Upstream cards of hybrid-thinking models recommend other values with thinking off.
    non_thinking: "SamplingDefaults | None" = None


class VisionCard(BaseModel):
    # Upstream vision sections differ per model family, so unknown keys are kept.
    model_config = ConfigDict(frozen=True, extra="allow")

    image_token_id: int | None = None
    model_type: str = ""
    weights_repo: str = ""
    processor_repo: str = ""


class ModelCard(FrozenModel):
    model_id: str
    n_layers: int = Field(gt=0)
    hidden_size: int
    num_key_value_heads: int | None = None
    supports_tensor: bool = False
    tasks: list[ModelTask]
    family: str = ""
    quantization: str = ""
    base_model: str = ""
    capabilities: list[str] = ["text"]
    reasoning_dialect: ReasoningDialect = ReasoningDialect.none
    context_length: int | None = None
    storage_size: StorageSize
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    vision: VisionCard | None = None
    # Layers from this index to the last must sit on one pipeline rank. Gemma 4 E2B/E4B
    # end in layers that read the keys and values of the last layers before them rather
    # than make their own, so a pipeline cut anywhere in that tail would cross ranks.
    pipeline_tail_start: int | None = Field(None, ge=0)


def _resource_dir(name: str) -> Path:
    return Path(str(files("exo") / "resources" / name))


def _load_card_file(path: Path) -> ModelCard:
    try:
        return ModelCard.model_validate(tomllib.loads(path.read_text()))
    except (tomllib.TOMLDecodeError, ValidationError) as error:
        raise ValueError(f"malformed model card {path}: {error}") from error


@functools.cache
def builtin_cards() -> dict[str, ModelCard]:
    cards: dict[str, ModelCard] = {}
    for path in sorted(_resource_dir("model_cards").glob("*.toml")):
        card = _load_card_file(path)
        if card.model_id in cards:
            raise ValueError(f"model card {path} repeats model_id {card.model_id}")
        cards[card.model_id] = card
    return cards


def _dirs_from_env(variable: str) -> list[Path]:
    return [Path(entry).expanduser() for entry in os.environ.get(variable, "").split(":") if entry]


def models_dirs(exo_home: Path) -> list[Path]:
    """Writable models dirs: the node's own first, where downloads go."""
    return [exo_home / "models", *_dirs_from_env("EXO_MODELS_DIRS")]


def read_only_models_dirs() -> list[Path]:
    """Models dirs exo never writes to; the package one ships the built-in demo model."""
    return [_resource_dir("models"), *_dirs_from_env("EXO_MODELS_READ_ONLY_DIRS")]


def model_dir_name(model_id: str) -> str:
    return model_id.replace("/", "--")


def _weight_files(path: Path) -> list[Path] | None:
    """The weight files a model dir should hold, or None if its index is unreadable."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError):
        return None
    return [path / name for name in sorted(set(weight_map.values()))]


def is_complete_model_dir(path: Path) -> bool:
    if not (path / "config.json").is_file():
        return False
    weights = _weight_files(path)
    if not weights or not all(weight.is_file() for weight in weights):
        return False
    tokenizer_files = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    return any((path / name).is_file() for name in tokenizer_files)


def _all_models_dirs(exo_home: Path) -> list[Path]:
    return [*models_dirs(exo_home), *read_only_models_dirs()]


def find_local_model_dir(model_id: str, exo_home: Path) -> Path | None:
    for models_dir in _all_models_dirs(exo_home):
        candidate = models_dir / model_dir_name(model_id)
        if is_complete_model_dir(candidate):
            return candidate
    return None


def _config_value(config: dict, key: str) -> int | None:
    # Multimodal configs (Gemma 4, Qwen-VL) keep the language model's numbers in text_config.
    if key in config:
        return config[key]
    return config.get("text_config", {}).get(key)


def has_tensor_strategy(model_type: str) -> bool:
    """Whether exo (engine/mlx/sharding/<model_type>.py, or a `shard` method in its own
    model module) or mlx-lm (a `shard` method in its model module) can split this architecture across ranks. Read from the files, so
    the node process need not import MLX; whether a given node count divides the model
    is placement's question."""
    if not model_type.isidentifier():
        return False
    engine = Path(__file__).parents[2] / "engine" / "mlx"
    if (engine / "sharding" / f"{model_type}.py").exists():
        return True
    own_model = engine / "models" / f"{model_type}.py"
    if own_model.exists():
        return "def shard(" in own_model.read_text(encoding="utf-8")
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.origin is None:
        return False
    module = Path(spec.origin).parent / "models" / f"{model_type}.py"
    return module.exists() and "def shard(" in module.read_text(encoding="utf-8")


# The reasoning dialect of each family, by config.json's model_type, as the built-in
# cards set it; a local model of a family behaves like the family's published models.
FAMILY_REASONING_DIALECTS: dict[str, ReasoningDialect] = {
    "qwen3": ReasoningDialect.post_last_user,
    "qwen3_moe": ReasoningDialect.post_last_user,
    "qwen3_next": ReasoningDialect.post_last_user,
    "deepseek_v3": ReasoningDialect.post_last_user,
    "glm4_moe": ReasoningDialect.post_last_user,
    "minimax_m2": ReasoningDialect.post_last_user,
    "kimi_k2": ReasoningDialect.suffix,
    "gpt_oss": ReasoningDialect.channel,
    "deepseek_v32": ReasoningDialect.tool_conditional,
    "deepseek_v4": ReasoningDialect.tool_conditional,
    # Gemma 4's cards set none: earlier thoughts never go back to the model.
    "gemma4": ReasoningDialect.none,
}


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


def card_from_model_dir(model_dir: Path, model_id: str) -> ModelCard:
    """A card derived from config.json alone, for models exo has no built-in card for."""
    config = json.loads((model_dir / "config.json").read_text())
    weight_bytes = sum(path.stat().st_size for path in _weight_files(model_dir) or [])
    try:
        return card_from_config(config, model_id, weight_bytes)
    except ValueError as error:
        raise ValueError(f"{model_dir / 'config.json'}: {error}") from error


def card_from_config(config: dict, model_id: str, weight_bytes: int) -> ModelCard:
    """A card from a model's config.json and the size of its weights (on disk, or as the
    hub lists them)."""
    n_layers = _config_value(config, "num_hidden_layers")
    hidden_size = _config_value(config, "hidden_size")
    if n_layers is None or hidden_size is None:
        raise ValueError("config.json has no num_hidden_layers or hidden_size")
    # Configs without num_key_value_heads use plain multi-head attention.
    kv_heads = _config_value(config, "num_key_value_heads") or _config_value(config, "num_attention_heads")
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    bits = quantization.get("bits")
    capabilities = ["text", "vision"] if "vision_config" in config else ["text"]
    model_type = config.get("model_type", "")
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
        reasoning_dialect=FAMILY_REASONING_DIALECTS.get(model_type, ReasoningDialect.none),
        context_length=_config_value(config, "max_position_embeddings"),
        storage_size=StorageSize(in_bytes=weight_bytes),
        pipeline_tail_start=kv_sharing_tail_start(config),
    )


def local_cards(exo_home: Path) -> dict[str, ModelCard]:
    """Cards for every complete `<org>--<name>` dir; a built-in card wins over a derived one."""
    builtin = builtin_cards()
    cards: dict[str, ModelCard] = {}
    for models_dir in _all_models_dirs(exo_home):
        if not models_dir.is_dir():
            continue
        for model_dir in sorted(models_dir.iterdir()):
            if "--" not in model_dir.name or not is_complete_model_dir(model_dir):
                continue
            model_id = model_dir.name.replace("--", "/", 1)
            if model_id in cards:
                continue
            try:
                cards[model_id] = builtin.get(model_id) or card_from_model_dir(model_dir, model_id)
            except ValueError as error:
                # One odd model dir must not hide every other local model.
                logger.warning(f"skipping model dir {model_dir}: {error}")
    return cards


def all_cards(exo_home: Path) -> dict[str, ModelCard]:
    return {**builtin_cards(), **local_cards(exo_home)}
