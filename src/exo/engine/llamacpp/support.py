"""Which engine an instance runs on nodes that run llama.cpp: llama.cpp where it can run
the model, else MLX on the same nodes. MLX-free: placement asks it with the model's card
and the refusals nodes report, and the runner again with the model's own config.json and
tokenizer before it loads.

A refusal met later (llama.cpp would not load the converted GGUF) is recorded beside the
GGUF cache, keyed like the GGUF by the dir's files and the converter's version: the node
runs that model on MLX from then on without converting it again, and reports the record
in its NodeInfo so placement and its preview say why."""

import json
import os
import re
from pathlib import Path

from exo.engine.llamacpp.gguf_convert import cache_prefix, cache_stem, supports
from exo.engine.llamacpp.gguf_vocab import vocab_refusal
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


def dir_refusal(model_dir: Path) -> str | None:
    """Why llama.cpp cannot run the model in `model_dir`, from its config.json and its
    tokenizer: files every rank holds, so every rank of an instance finds the same."""
    return supports(json.loads((model_dir / "config.json").read_text())) or vocab_refusal(model_dir)


class LlamaCppRefused(RuntimeError):
    """llama.cpp would not load a model exo converted for it; the message says why."""


def gguf_cache_dir(home: Path | None = None) -> Path:
    """Where a node keeps its converted GGUFs and its records of refused models."""
    home = home or Path(os.environ.get("EXO_HOME", Path.home() / ".exo")).expanduser()
    return home / "cache" / "gguf"


def record_refusal(cache_dir: Path, model_dir: Path, model_id: str, reason: str) -> None:
    """Remember that llama.cpp cannot run the model in `model_dir`, and drop its GGUF:
    one llama.cpp would not load is of no use."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = cache_stem(model_dir)
    record = {"model_id": model_id, "model_dir": str(model_dir.resolve()), "stem": stem, "reason": reason}
    (cache_dir / f"{stem}.refused").write_text(json.dumps(record))
    for gguf in cache_dir.glob(f"{cache_prefix(model_dir)}*.gguf"):
        gguf.unlink(missing_ok=True)


def recorded_refusal(cache_dir: Path, model_dir: Path) -> str | None:
    """Why llama.cpp refused the model in `model_dir` on this node, if it did since the
    dir's files last changed."""
    path = cache_dir / f"{cache_stem(model_dir)}.refused"
    return json.loads(path.read_text())["reason"] if path.is_file() else None


def recorded_refusals(cache_dir: Path) -> dict[str, str]:
    """The models llama.cpp refused on this node, by id, with why: the records whose
    model dir is still as it was."""
    refusals: dict[str, str] = {}
    for path in sorted(cache_dir.glob("*.refused")):
        try:
            record = json.loads(path.read_text())
            if cache_stem(Path(record["model_dir"])) == record["stem"]:
                refusals[record["model_id"]] = record["reason"]
        except (OSError, ValueError, KeyError):
            continue  # a dir gone or changed, or a record cut short: llama.cpp may try again
    return refusals
