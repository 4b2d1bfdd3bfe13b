"""Which engine an instance runs on nodes that run llama.cpp: llama.cpp where it can run
the model, else MLX on the same nodes. Pure, MLX-free: placement asks it with the model's
card, and the runner again with the model's own config.json before it loads."""

import json
import re
from pathlib import Path

from exo.engine.llamacpp.gguf_convert import supports
from exo.shared.models.model_cards import ModelCard
from exo.shared.types.instances import Sharding

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


def card_formats(card: ModelCard) -> list[str]:
    """The weights each engine runs the card's model from: MLX from the checkpoint as
    published, llama.cpp from a GGUF a node converts from it once and caches (or why
    there is none)."""
    published = f"safetensors, {card.quantization or 'float'} (MLX runs it as published)"
    refusal = card_refusal(card)
    if refusal is not None:
        return [published, f"no GGUF: {refusal}"]
    bits = re.fullmatch(r"(\d+)bit", card.quantization)
    if bits is None:
        gguf = "the checkpoint's own float type (F32, BF16 or F16)"
    elif bits[1] == "4":
        gguf = "Q4_K where its rows are whole 256-blocks, else Q4_1"
    else:
        gguf = "Q8_0"
    return [published, f"GGUF, {gguf} (llama.cpp; converted on the node, cached)"]


def mlx_reason(card: ModelCard, sharding: Sharding, world_size: int, sealed: bool) -> str | None:
    """Why an instance of `card` on nodes that run llama.cpp runs MLX instead, if it does."""
    if sharding == Sharding.Tensor:
        return "a tensor split runs on MLX (llama.cpp splits by layers only)"
    if sealed and world_size > 1:
        # ggml's RPC protocol has no authentication: a follower's port would serve whoever
        # reaches it, outside what the cluster secret seals. The MLX ring's are sealed.
        return "a split runs on MLX with a cluster secret: llama.cpp's RPC port is unauthenticated"
    refusal = card_refusal(card)
    return None if refusal is None else f"runs on MLX: {refusal}"


def config_refusal(model_dir: Path) -> str | None:
    """Why llama.cpp cannot run the model in `model_dir`, from its own config.json."""
    return supports(json.loads((model_dir / "config.json").read_text()))
