"""Which weight files a pipeline rank needs, from the model's safetensors index (the
worker downloads them, the engine checks a dir holds them before loading)."""

import re

INDEX_FILE = "model.safetensors.index.json"
# `model.layers.12.mlp...`, `backbone.layers.3...`, `model.language_model.layers.0...`
_LAYER_OF_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The language model's own module, as checkpoints name it (text models, VLMs in
# transformers' old and new layouts).
_TEXT_MODEL = r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?"
# The tensors only the first rank reads (the embeddings), and only the last (the final
# norm and the head), under the names the MLX engine leaves out on the other ranks
# (engine/mlx/parallel.py's drop_unused_ends). Other tensors of no layer go to every rank.
_EMBEDDINGS = re.compile(_TEXT_MODEL + r"embed_tokens\.")
_FINAL_NORM = re.compile(_TEXT_MODEL + r"norm\.")
_HEAD = re.compile(r"^(?:model\.|model\.language_model\.|language_model\.)?lm_head\.")
# Gemma 3n / 4 compute every layer's extra input from the embeddings: every rank embeds.
_PER_LAYER_EMBEDDINGS = "embed_tokens_per_layer"


def layer_count(weight_map: dict[str, str]) -> int:
    """One past the highest layer the index names (a checkpoint may carry extra layers,
    DeepSeek's multi-token prediction: callers that know the config pass its count)."""
    indices = [int(match.group(1)) for tensor in weight_map if (match := _LAYER_OF_TENSOR.search(tensor))]
    return max(indices, default=-1) + 1


def config_layer_count(config: object) -> int | None:
    """The language model's layer count in a config.json (VLMs keep it in text_config)."""
    if not isinstance(config, dict):
        return None
    count = config.get("num_hidden_layers")
    text = config.get("text_config")
    if count is None and isinstance(text, dict):
        count = text.get("num_hidden_layers")
    return count if isinstance(count, int) and count > 0 else None


def files_for_layers(
    weight_map: dict[str, str], layers: tuple[int, int] | None, n_layers: int | None = None
) -> set[str]:
    """The files holding the tensors of layers [start, end) of a model of `n_layers`
    (None: as the index says), plus those of the tensors of no layer the rank reads: the
    embeddings on the first rank (on every rank where each layer takes an input from
    them, and on the last where the head is the embeddings, tied), the final norm and
    the head on the last, and any other tensor on every rank. None: all; an empty range:
    none (a rank that is sent its weights, as a llama.cpp follower is)."""
    if layers is None:
        return set(weight_map.values())
    start, end = layers
    if start == end:
        return set()
    first, last = start == 0, end >= (n_layers or layer_count(weight_map))
    tied = not any(_HEAD.match(tensor) for tensor in weight_map)
    every_rank_embeds = any(_PER_LAYER_EMBEDDINGS in tensor for tensor in weight_map)
    needed = set()
    for tensor, file in weight_map.items():
        match = _LAYER_OF_TENSOR.search(tensor)
        if match is not None:
            wanted = start <= int(match.group(1)) < end
        elif _EMBEDDINGS.match(tensor):
            wanted = first or every_rank_embeds or (last and tied)
        elif _HEAD.match(tensor) or _FINAL_NORM.match(tensor):
            wanted = last
        else:
            wanted = True
        if wanted:
            needed.add(file)
    return needed
