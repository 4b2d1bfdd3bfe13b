"""Pieces the per-architecture strategies share."""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_map


class AllSum(nn.Module):
    """Sums a row-split block's partial outputs over the group. For blocks whose own
    code has no all-sum hook (mlx-lm's `sharding_group`)."""

    def __init__(self, block: nn.Module, group: mx.distributed.Group) -> None:
        super().__init__()
        self.block = block
        self.group = group

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return mx.distributed.all_sum(self.block(*args, **kwargs), group=self.group)


def repeat_heads(linear: nn.Module, n_heads: int, group_size: int) -> None:
    """With fewer KV heads than ranks, every rank needs a whole head: repeat each head's
    rows so the split hands rank r the head its query heads group with."""
    if n_heads >= group_size:
        return

    def repeat(weight: mx.array) -> mx.array:
        rows = weight.reshape(n_heads, weight.shape[0] // n_heads, *weight.shape[1:])
        return mx.repeat(rows, group_size // n_heads, axis=0).reshape(-1, *weight.shape[1:])

    linear.update(tree_map(repeat, linear.parameters()))


def shard_attention(attn: nn.Module, group: mx.distributed.Group, heads_attr: str, kv_heads_attr: str | None) -> None:
    """Heads split across ranks: q/k/v column-split, o row-split with the all-sum.
    `kv_heads_attr` is None for layers that read another layer's keys and values."""
    n = group.size()
    attn["q_proj"] = shard_linear(attn["q_proj"], "all-to-sharded", group=group)
    attn["o_proj"] = shard_linear(attn["o_proj"], "sharded-to-all", group=group)
    setattr(attn, heads_attr, getattr(attn, heads_attr) // n)
    if kv_heads_attr is None:
        return
    n_kv = getattr(attn, kv_heads_attr)
    for name in ("k_proj", "v_proj"):
        if name in attn:
            repeat_heads(attn[name], n_kv, n)
            attn[name] = shard_linear(attn[name], "all-to-sharded", group=group)
    setattr(attn, kv_heads_attr, max(1, n_kv // n))


def shard_mlp(mlp: nn.Module, group: mx.distributed.Group, inputs: tuple[str, ...], output: str) -> None:
    """A dense MLP: its input projections column-split, its output row-split with the all-sum."""
    for name in inputs:
        mlp[name] = shard_linear(mlp[name], "all-to-sharded", group=group)
    mlp[output] = shard_linear(mlp[output], "sharded-to-all", group=group)


def shard_weights_inplace(mlp: nn.Module, group: mx.distributed.Group, inputs: tuple[str, ...], output: str) -> None:
    """Like shard_mlp but without communication, for experts whose sum happens once
    for the whole MoE block."""
    for name in inputs:
        shard_inplace(mlp[name], "all-to-sharded", group=group)
    shard_inplace(mlp[output], "sharded-to-all", group=group)
    if "bias" in mlp[output]:
        # Every rank adds the whole bias before the sum; a share each adds it once.
        mlp[output].bias = mlp[output].bias / group.size()
