"""Loading a model shard from an HF-layout directory with mlx-lm's model classes."""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

import exo.engine.mlx.models  # noqa: F401  (registers exo's own model modules, DeepSeek V4, with mlx-lm)
from exo.engine.base import LayerProgress
from exo.engine.mlx.parallel import shard_model
from exo.shared.types.shards import ShardMetadata


def model_layers(model: nn.Module) -> list[nn.Module]:
    # mlx-lm models expose their blocks as `.layers` on the outer or the inner model.
    if hasattr(model, "layers"):
        return list(model.layers)
    return list(model.model.layers)


# Turn ends a family's config does not list as EOS. Gemma 3/4 checkpoints name only <eos>
# (1); the turn end (106) and the tool-response marker (50) end generation too.
FAMILY_EOS_IDS = {model_type: (1, 106, 50) for model_type in ("gemma3", "gemma3_text", "gemma4", "gemma4_text")}


def add_family_eos_ids(tokenizer: TokenizerWrapper, model_type: str) -> None:
    """Only ids the tokenizer itself treats as special: in a small test vocabulary the
    same numbers are ordinary tokens."""
    added = getattr(tokenizer._tokenizer, "added_tokens_decoder", {})
    special = {token_id for token_id, token in added.items() if token.special}
    extra = [i for i in FAMILY_EOS_IDS.get(model_type, ()) if i in special]
    if extra:
        tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(extra)


def load_shard(
    model_dir: Path, shard: ShardMetadata, group: mx.distributed.Group | None, on_layer_loaded: LayerProgress
) -> tuple[nn.Module, TokenizerWrapper]:
    model, config = load_model(model_dir, lazy=True)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    add_family_eos_ids(tokenizer, config["model_type"])
    # Shard while the weights are still lazy, so only this rank's part is ever read.
    shard_model(model, config["model_type"], shard, group)
    layers = model_layers(model)
    # Materialise layer by layer so progress is visible and peak memory grows smoothly.
    for loaded, layer in enumerate(layers, 1):
        mx.eval(layer.parameters())
        on_layer_loaded(loaded, len(layers))
    mx.eval(model.parameters())
    if group is not None:
        # Nobody starts serving until every rank has its weights.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return model, tokenizer
