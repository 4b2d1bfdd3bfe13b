"""NemotronH: a hybrid stack of Mamba-2 mixers (M), attention (*), ReLU² MLPs (-) and
MoE blocks (E).

The Mamba-2 mixer splits by SSM groups: its fused input projection is
[gate | x | B | C | dt], where x, gate and dt are per head, heads come group by group,
and B and C are per group, so each part splits contiguously and rank r keeps whole
groups with their heads. The conv runs over [x | B | C] channel by channel and splits
the same way; the gated norm normalises within a group, so it needs no communication."""

import mlx.core as mx
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.nemotron_h import (
    Model,
    NemotronHAttention,
    NemotronHBlock,
    NemotronHMamba2Mixer,
    NemotronHMLP,
    NemotronHMoE,
)

from exo.engine.mlx.sharding.common import AllSum, shard_attention, shard_mlp, shard_weights_inplace


def shard(model: Model, group: mx.distributed.Group) -> None:
    for layer in model.layers:
        match layer.mixer:
            case NemotronHMamba2Mixer():
                _shard_mamba(layer.mixer, group)
            case NemotronHAttention():
                shard_attention(layer.mixer, group, "num_heads", "num_key_value_heads")
            case NemotronHMLP():
                shard_mlp(layer.mixer, group, ("up_proj",), "down_proj")
            case NemotronHMoE():
                _shard_moe(layer, layer.mixer, group)


def _shard_mamba(mixer: NemotronHMamba2Mixer, group: mx.distributed.Group) -> None:
    n, rank = group.size(), group.rank()
    if mixer.n_groups % n:
        raise ValueError(f"{mixer.n_groups} SSM groups do not split over {n} ranks")
    inner, bc = mixer.intermediate_size, mixer.n_groups * mixer.ssm_state_size
    shard_inplace(
        mixer.in_proj, "all-to-sharded", segments=[inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc], group=group
    )
    shard_inplace(mixer.conv1d, lambda _path, _w: (0, [inner, inner + bc]), group=group)
    for name in ("dt_bias", "A_log", "D"):
        setattr(mixer, name, mx.contiguous(mx.split(getattr(mixer, name), n)[rank]))
    mixer.norm.weight = mx.contiguous(mx.split(mixer.norm.weight, n)[rank])
    mixer.out_proj = shard_linear(mixer.out_proj, "sharded-to-all", group=group)
    mixer.conv1d.groups //= n
    mixer.num_heads //= n
    mixer.intermediate_size //= n
    mixer.n_groups //= n
    mixer.conv_dim //= n


def _shard_moe(layer: NemotronHBlock, moe: NemotronHMoE, group: mx.distributed.Group) -> None:
    """Routed and shared experts each keep a slice of their hidden units; the block's
    output is summed once. The router and the latent projections stay whole."""
    shard_weights_inplace(moe.switch_mlp, group, ("fc1",), "fc2")
    if "shared_experts" in moe:
        shard_weights_inplace(moe.shared_experts, group, ("up_proj",), "down_proj")
    if "fc2_latent_proj" in moe and "bias" in moe.fc2_latent_proj:
        # Applied to each rank's partial sum before the all-sum: a share of the bias each.
        moe.fc2_latent_proj.bias = moe.fc2_latent_proj.bias / group.size()
    # Set as an item: mlx-lm's block types `mixer` as one of its four mixer classes.
    layer["mixer"] = AllSum(moe, group)


def fix_pipeline(model: Model, start: int, end: int) -> None:
    """The backbone builds its masks from the cache of its first attention and first
    Mamba layer, by index into the cache list (which holds only M and * layers). A rank
    without one of the two kinds gets a spare, never-written cache of that kind at the
    end of its list, to build the (unused) mask from."""
    backbone = model.backbone
    with_cache = [layer.block_type for layer in backbone.layers if layer.block_type in ("M", "*")]
    spares = [kind for kind in ("*", "M") if kind not in with_cache]
    kinds = with_cache + spares
    backbone.fa_idx, backbone.ssm_idx = kinds.index("*"), kinds.index("M")
    if spares:
        make_cache = model.make_cache
        model.make_cache = lambda: [*make_cache(), *(KVCache() if k == "*" else ArraysCache(size=2) for k in spares)]
