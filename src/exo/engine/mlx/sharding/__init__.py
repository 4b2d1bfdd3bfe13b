"""Tensor-parallel strategies exo adds where mlx-lm's model module has no `shard`.

One module per architecture, named after the config's `model_type`, each with
`shard(model, group)`. The rule is mlx-lm's: column-split what reads the residual
stream, row-split what writes back to it, one all-sum per block."""

import importlib
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

TensorStrategy = Callable[[nn.Module, mx.distributed.Group], None]


def tensor_strategy(model_type: str) -> TensorStrategy | None:
    if not model_type.isidentifier():
        return None
    try:
        module = importlib.import_module(f"{__name__}.{model_type}")
    except ModuleNotFoundError:
        return None
    return module.shard
