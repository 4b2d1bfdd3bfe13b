"""Qwen3-Next: gated attention, gated delta-net linear attention and a sparse MoE with a
shared expert.

The delta-net's fused projections lay their outputs out key head by key head (each
key head followed by its value heads), so a contiguous split hands every rank whole key
heads with the value heads that belong to them; the conv channels are [q | k | v] and
split per part."""

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models.qwen3_next import Model, Qwen3NextGatedDeltaNet, Qwen3NextSparseMoeBlock

from exo.engine.mlx.sharding.common import shard_attention, shard_mlp, shard_weights_inplace


def shard(model: Model, group: mx.distributed.Group) -> None:
    for layer in model.layers:
        if layer.is_linear:
            _shard_delta_net(layer.linear_attn, group)
        else:
            shard_attention(layer.self_attn, group, "num_attention_heads", "num_key_value_heads")
        if isinstance(layer.mlp, Qwen3NextSparseMoeBlock):
            # The block sums routed and shared experts, then all-sums once. mlx-lm starts
            # the attribute at None without declaring it may hold a group.
            layer.mlp.sharding_group = group  # pyright: ignore[reportAttributeAccessIssue]
            shard_weights_inplace(layer.mlp.switch_mlp, group, ("gate_proj", "up_proj"), "down_proj")
            shard_weights_inplace(layer.mlp.shared_expert, group, ("gate_proj", "up_proj"), "down_proj")
        else:
            shard_mlp(layer.mlp, group, ("gate_proj", "up_proj"), "down_proj")


def _shard_delta_net(net: Qwen3NextGatedDeltaNet, group: mx.distributed.Group) -> None:
    n, rank = group.size(), group.rank()
    if net.num_k_heads % n:
        raise ValueError(f"{net.num_k_heads} linear-attention key heads do not split over {n} ranks")
    key_dim = net.key_dim
    shard_inplace(net.conv1d, lambda _path, _w: (0, [key_dim, 2 * key_dim]), group=group)
    shard_inplace(net.in_proj_qkvz, "all-to-sharded", group=group)
    shard_inplace(net.in_proj_ba, "all-to-sharded", group=group)
    net.dt_bias = mx.contiguous(mx.split(net.dt_bias, n)[rank])
    net.A_log = mx.contiguous(mx.split(net.A_log, n)[rank])
    net.out_proj = shard_linear(net.out_proj, "sharded-to-all", group=group)
    net.conv1d.groups //= n
    net.num_k_heads //= n
    net.num_v_heads //= n
    net.key_dim //= n
    net.value_dim //= n
    net.conv_dim //= n
