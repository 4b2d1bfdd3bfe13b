"""Gemma 4 (text path): sliding and full attention with different head sizes, KV-shared
layers, k_eq_v full-attention layers, and on the MoE models a dense MLP beside the experts.

- KV-shared layers have no k/v projections: they read the keys and values an earlier
  layer made, which on this rank are that layer's local heads, so only their query and
  output projections split.
- k_eq_v layers have only k_proj (values are the keys before their norms); it splits
  like any KV projection.
- On MoE layers the dense MLP and the experts each go through their own norm before they
  are added, so each needs its own all-sum; the router reads the full residual stream
  and stays whole.
- The per-layer-input gate (E2B/E4B) is small and runs replicated."""

import mlx.core as mx
from mlx_lm.models import gemma4, gemma4_text

from exo.engine.mlx.sharding.common import AllSum, shard_attention, shard_mlp, shard_weights_inplace


def shard(model: gemma4.Model | gemma4_text.Model, group: mx.distributed.Group) -> None:
    for layer in model.layers:
        attn = layer.self_attn
        shard_attention(attn, group, "n_heads", "n_kv_heads" if attn.has_kv else None)
        shard_mlp(layer.mlp, group, ("gate_proj", "up_proj"), "down_proj")
        if layer.enable_moe:
            shard_weights_inplace(layer.experts.switch_glu, group, ("gate_proj", "up_proj"), "down_proj")
            # Set as an item: mlx-lm types `experts` as its Experts class.
            layer["experts"] = AllSum(layer.experts, group)


def fix_pipeline(model: gemma4.Model | gemma4_text.Model, start: int, end: int) -> None:
    """After slicing to layers [start, end): the KV-sharing map, the per-layer inputs
    and the caches were all built for the full stack; make them describe this rank's."""
    text = model.language_model if isinstance(model, gemma4.Model) else model
    inner, args = text.model, text.args
    sources = [inner.previous_kvs[i] - start for i in range(start, end)]
    if any(source < 0 for source in sources):
        raise ValueError(
            f"Gemma 4 layers {start}..{end - 1} read keys and values made by layer "
            f"{min(sources) + start}, which another rank holds; split the pipeline before that layer"
        )
    inner.previous_kvs = sources

    project = inner._project_per_layer_inputs
    inner._project_per_layer_inputs = lambda *a, **kw: project(*a, **kw)[:, :, start:end, :]

    first_shared = args.num_hidden_layers - args.num_kv_shared_layers
    with_own_kv = [i for i in range(start, min(end, first_shared))]
    make_cache = text.make_cache
    text.make_cache = lambda: make_cache()[with_own_kv[0] : with_own_kv[-1] + 1] if with_own_kv else []
