"""Loading a model shard from an HF-layout directory with mlx-lm's model classes."""

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from loguru import logger
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

import exo.engine.mlx.models  # noqa: F401  (registers exo's own model modules, DeepSeek V4, with mlx-lm)
from exo.engine.base import LayerProgress
from exo.engine.mlx.parallel import shard_model
from exo.shared.models.families import family_facts
from exo.shared.models.vision import processor_chat_template, vision_runs
from exo.shared.models.weight_files import INDEX_FILE, files_for_layers
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata


def model_layers(model: nn.Module) -> list[nn.Module]:
    # mlx-lm models expose their blocks as `.layers` on the outer or the inner model.
    owner: Any = model if hasattr(model, "layers") else model.model
    return list(owner.layers)


def add_family_eos_ids(tokenizer: TokenizerWrapper, model_type: str) -> None:
    """The family's turn ends that its config does not list as EOS. Only ids the
    tokenizer itself treats as special: in a small test vocabulary the same numbers are
    ordinary tokens."""
    added = getattr(tokenizer._tokenizer, "added_tokens_decoder", {})
    special = {token_id for token_id, token in added.items() if token.special}
    extra = [i for i in family_facts(model_type).eos_ids if i in special]
    if extra:
        tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(extra)


def holds_only_some_shards(model_dir: Path, shard: ShardMetadata) -> bool:
    """Whether the dir holds only some of the model's weight files (a node downloads only
    those its pipeline rank needs); raises if it lacks one this shard needs."""
    index = model_dir / INDEX_FILE
    if not index.is_file():
        return False
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    if all((model_dir / name).is_file() for name in set(weight_map.values())):
        return False
    layers = (shard.start_layer, shard.end_layer) if isinstance(shard, PipelineShardMetadata) else None
    needed = files_for_layers(weight_map, layers, shard.n_layers)
    missing = sorted(name for name in needed if not (model_dir / name).is_file())
    if missing:
        raise FileNotFoundError(
            f"{model_dir} lacks {', '.join(missing)}, needed for layers {shard.start_layer}-{shard.end_layer}"
        )
    return True


def _recording_loaded(loaded: dict[int, mx.array]) -> Any:
    """mlx-lm's model classes, whose load_weights notes the arrays it is given (by id, as
    a pipeline rank may wrap a module, which renames its weights; held, so no id is reused)."""

    def classes(config: dict) -> tuple[type[nn.Module], type]:
        model_class, args_class = _get_classes(config)

        class Recording(model_class):  # type: ignore[misc, valid-type]
            def load_weights(self, weights: list[tuple[str, mx.array]], strict: bool = True) -> Any:
                loaded.update((id(array), array) for _, array in weights)
                return super().load_weights(weights, strict=strict)

        Recording.__name__ = Recording.__qualname__ = model_class.__name__
        return Recording, args_class

    return classes


def check_ends_loaded(model: nn.Module, loaded: dict[int, mx.array], model_dir: Path) -> None:
    """A rank loading some of the files: every weight it kept outside its layers (the
    embeddings, norm and head it reads, any other) was in them. Without this check a
    weight left out by the download but read by the model would stay random."""
    missing = sorted(
        name
        for name, leaf in tree_flatten(model.parameters())
        if isinstance(leaf, mx.array) and ".layers." not in f".{name}" and id(leaf) not in loaded
    )
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks weights this rank reads: {', '.join(missing[:5])}")


def set_wired_limit(weight_bytes: int) -> None:
    """On Metal, lets MLX keep up to the GPU's recommended working set wired (resident,
    never paged out) before the weights arrive, as mlx-lm's generate does; without it
    macOS may page weights out between tokens. Other backends have no wired memory."""
    if not mx.metal.is_available():
        logger.info(f"no Metal device: wired-memory limit not set ({weight_bytes >> 20} MiB of weights)")
        return
    limit = int(mx.device_info()["max_recommended_working_set_size"])
    if weight_bytes > 0.9 * limit:
        logger.warning(
            f"weights of {weight_bytes >> 20} MiB are close to the recommended working set of "
            f"{limit >> 20} MiB: generation may be slow"
        )
    mx.set_wired_limit(limit)
    logger.info(f"wired-memory limit set to {limit >> 20} MiB for {weight_bytes >> 20} MiB of weights")


def load_shard(
    model_dir: Path, shard: ShardMetadata, group: mx.distributed.Group | None, on_layer_loaded: LayerProgress
) -> tuple[nn.Module, TokenizerWrapper]:
    # With only this rank's shards on disk, the other layers' weights stay unloaded: their
    # layers are dropped by shard_model below before anything is evaluated.
    some_shards, loaded = holds_only_some_shards(model_dir, shard), dict[int, mx.array]()
    model, config = load_model(
        model_dir, lazy=True, strict=not some_shards, get_model_classes=_recording_loaded(loaded)
    )
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    add_family_eos_ids(tokenizer, config["model_type"])
    if vision_runs(config) and (template := processor_chat_template(model_dir)) is not None:
        # Every rank renders with it: a VLM's prompts are its processor's.
        tokenizer._tokenizer.chat_template = template
    # Shard while the weights are still lazy, so only this rank's part is ever read.
    shard_model(model, config["model_type"], shard, group)
    if some_shards:
        check_ends_loaded(model, loaded, model_dir)
    loaded.clear()
    # Still lazy: the sizes are this rank's share, nothing is read yet.
    set_wired_limit(sum(p.nbytes for _, p in tree_flatten(model.parameters()) if isinstance(p, mx.array)))
    layers = model_layers(model)
    # Materialise layer by layer so progress is visible and peak memory grows smoothly.
    # Reading a layer leaves temporaries in MLX's buffer cache (a tensor rank's whole
    # unsharded weights, experts before they are stacked, dequantized originals); giving
    # them back after each layer keeps the memory held at the weights loaded so far.
    for loaded, layer in enumerate(layers, 1):
        mx.eval(layer.parameters())
        mx.clear_cache()
        on_layer_loaded(loaded, len(layers))
    mx.eval(model.parameters())
    mx.clear_cache()
    if group is not None:
        # Nobody starts serving until every rank has its weights.
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return model, tokenizer
