"""Which engine an instance runs on nodes that run llama.cpp: llama.cpp where it can run
the model, else MLX on the same nodes. Pure, MLX-free: placement asks it with the model's
card, and the runner again with the model's own config.json before it loads."""

import json
import re
from pathlib import Path

from exo.engine.llamacpp.gguf_convert import supports
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.instances import EngineKind, Sharding

_FLOAT = {"", "bf16", "fp16", "f16", "fp32", "f32"}


def card_refusal(card: ModelCard) -> str | None:
    """Why llama.cpp cannot run the card's model, as far as the card tells: a model dir's
    card names its config's model_type as family and its bits as quantization (MLX's
    affine groups of 64 unless its config says otherwise)."""
    if "vision" in card.capabilities:
        return "the llama.cpp engine takes no images"
    config: dict = {"model_type": card.family}
    if card.quantization not in _FLOAT:
        bits = re.fullmatch(r"(\d+)bit", card.quantization)
        if bits is None:
            return f"{card.quantization} weights have no ggml mapping"
        config["quantization"] = {"bits": int(bits[1]), "group_size": 64}
    return supports(config)


def instance_engine(nodes_engine: EngineKind, card: ModelCard, sharding: Sharding) -> EngineKind:
    """The engine of an instance of `card` on nodes that all run `nodes_engine`."""
    if nodes_engine != EngineKind.LlamaCpp or sharding == Sharding.Tensor or card_refusal(card) is not None:
        return EngineKind.Mlx
    return EngineKind.LlamaCpp


def config_refusal(model_dir: Path) -> str | None:
    """Why llama.cpp cannot run the model in `model_dir`, from its own config.json."""
    return supports(json.loads((model_dir / "config.json").read_text()))
