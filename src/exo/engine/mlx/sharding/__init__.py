"""Tensor-parallel strategies exo adds where mlx-lm's model module has no `shard`, and
pipeline fix-ups for models whose forward pass assumes it holds every layer.

One module per architecture, named after the config's `model_type`, each with
`shard(model, group)` and, where needed, `fix_pipeline(model, start, end)`; the family
table (exo.shared.models.families) says which model types have which. The tensor rule is
mlx-lm's: column-split what reads the residual stream, row-split what writes back to it,
one all-sum per block."""

import importlib
from collections.abc import Callable
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from exo.shared.models.families import StrategyOwner, family_facts

TensorStrategy = Callable[[nn.Module, mx.distributed.Group], None]
PipelineFixUp = Callable[[nn.Module, int, int], None]


def _module(model_type: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{model_type}")


def tensor_strategy(model_type: str) -> TensorStrategy | None:
    """exo's own strategy; None where the model class's `shard()` does it, or nothing does."""
    if family_facts(model_type).tensor_strategy != StrategyOwner.exo:
        return None
    return _module(model_type).shard


def pipeline_fix_up(model_type: str) -> PipelineFixUp | None:
    if not family_facts(model_type).pipeline_fix_up:
        return None
    return _module(model_type).fix_pipeline
