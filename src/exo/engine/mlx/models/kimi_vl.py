"""Kimi-VL's language model: mlx-lm's DeepSeek V3 under `language_model.`, where Kimi-VL
checkpoints keep it beside the vision tower and projector (engine/mlx/vision.py loads
those).

mlx-lm's own kimi_vl module cannot serve it: its sanitize stacks the experts but leaves
each attention's kv_b_proj whole, where its DeepSeek V3 attention wants the projection
split per head into embed_q and unembed_out (so no Kimi-VL checkpoint loads), and its
model takes no input embeddings, which the image features come in as. Here the whole of
DeepSeek V3's sanitize runs on the language model's weights, and the inner model takes
`input_embeddings` as mlx-lm's other VLM language models do."""

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3
from mlx_lm.models.base import BaseModelArgs, create_attention_mask

_PREFIX = "language_model."


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict[str, Any]


class KimiTextModel(deepseek_v3.DeepseekV3Model):
    def __call__(  # pyright: ignore[reportIncompatibleMethodOverride]
        self, inputs: mx.array, cache: list[Any] | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        # exo splits pipelines by its own layer wrappers (engine/mlx/parallel.py), never
        # by mlx-lm's pipeline(), so this rank's layers are all it holds.
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        layers = self.pipeline_layers
        caches = cache if cache is not None else [None] * len(layers)
        mask = create_attention_mask(h, caches[0], return_array=True)
        for layer, layer_cache in zip(layers, caches, strict=True):
            h = layer(h, mask, cache=layer_cache)
        return self.norm(h)


class KimiLanguageModel(deepseek_v3.Model):
    def __init__(self, args: deepseek_v3.ModelArgs) -> None:
        super().__init__(args)
        self.model = KimiTextModel(args)


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = KimiLanguageModel(deepseek_v3.ModelArgs.from_dict(args.text_config))

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        text = self.language_model
        return text.lm_head(text.model(inputs, cache, input_embeddings))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The language model's weights, through DeepSeek V3's sanitize (experts stacked,
        kv_b_proj split, fp8 dequantized); the vision side's are left to the vision loader."""
        text = {name[len(_PREFIX) :]: value for name, value in weights.items() if name.startswith(_PREFIX)}
        return {_PREFIX + name: value for name, value in self.language_model.sanitize(text).items()}

    def shard(self, group: mx.distributed.Group | None = None) -> None:
        self.language_model.shard(group)

    @property
    def layers(self) -> list[nn.Module]:
        return self.language_model.layers

    @property
    def cast_predicate(self) -> Any:
        return self.language_model.cast_predicate
