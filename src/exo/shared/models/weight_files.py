"""Which weight files a pipeline rank needs, from the model's safetensors index (the
worker downloads them, the engine checks a dir holds them before loading)."""

import re

INDEX_FILE = "model.safetensors.index.json"
# `model.layers.12.mlp...`, `backbone.layers.3...`, `model.language_model.layers.0...`
_LAYER_OF_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def files_for_layers(weight_map: dict[str, str], layers: tuple[int, int] | None) -> set[str]:
    """The files holding the tensors of layers [start, end), plus every file holding a
    tensor that belongs to no layer (embeddings, final norm, head): every rank reads those,
    because the first embeds the prompt, and in exo's pipeline every rank computes the
    logits from the last rank's output (rank 0 samples from them), so each needs the head;
    an absent embedding would be built at full precision from random numbers. None: all;
    an empty range: none (a rank that is sent its weights, as a llama.cpp follower is)."""
    if layers is None:
        return set(weight_map.values())
    start, end = layers
    if start == end:
        return set()
    needed = set()
    for tensor, file in weight_map.items():
        match = _LAYER_OF_TENSOR.search(tensor)
        if match is None or start <= int(match.group(1)) < end:
            needed.add(file)
    return needed
