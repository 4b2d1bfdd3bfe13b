"""Tensor-parallel strategies exo adds where mlx-lm's model module has no `shard`, and
pipeline fix-ups for models whose forward pass assumes it holds every layer.

One module per architecture, named after the config's `model_type`, each with
`shard(model, group)` and, where needed, `fix_pipeline(model, start, end)`. The tensor
rule is mlx-lm's: column-split what reads the residual stream, row-split what writes
back to it, one all-sum per block."""

import importlib
from collections.abc import Callable
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

TensorStrategy = Callable[[nn.Module, mx.distributed.Group], None]
PipelineFixUp = Callable[[nn.Module, int, int], None]


def _module(model_type: str) -> ModuleType | None:
    if not model_type.isidentifier():
        return None
    try:
        return importlib.import_module(f"{__name__}.{model_type}")
    except ModuleNotFoundError:
        return None


def tensor_strategy(model_type: str) -> TensorStrategy | None:
    return getattr(_module(model_type), "shard", None)


def pipeline_fix_up(model_type: str) -> PipelineFixUp | None:
    return getattr(_module(model_type), "fix_pipeline", None)
