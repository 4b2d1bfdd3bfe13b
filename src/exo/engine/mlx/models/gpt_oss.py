"""gpt-oss as mlx-lm writes it, with YaRN's ramp and the SwiGLU clamp as gpt-oss'
config asks for them.

gpt-oss' configs say `"truncate": false` in `rope_scaling`: the band of rotary
dimensions that blends interpolated and original frequencies starts and ends at the
fractional dimensions YaRN's formula gives, as OpenAI's reference computes it
(gpt_oss/torch/model.py, `RotaryEmbedding._compute_concentration_and_inv_freq`: no
rounding) and transformers does. mlx-lm's `YarnRoPE` always rounds them (floor, ceil)
and ignores the key, so the frequencies inside the band differ and the logits drift
with the position (0.35 in a tiny random model over 64 tokens). Here the periods are
computed unrounded when the config asks. mlx-lm also clamps the experts' gate and up
values at 7.0 whatever the config's `swiglu_limit` (7.0 in gpt-oss' own configs); here
the config's value is used, as OpenAI's reference and transformers do."""

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import gpt_oss as upstream

__all__ = ["Model", "ModelArgs"]


@dataclass
class ModelArgs(upstream.ModelArgs):
    swiglu_limit: float = 7.0


def unrounded_yarn_periods(dims: int, base: float, scaling: dict) -> mx.array:
    """The per-pair periods `mx.fast.rope` takes as `freqs`, for YaRN with an unrounded
    correction range (mlx-lm's YarnRoPE formula otherwise)."""

    def correction_dim(rotations: float) -> float:
        original = scaling["original_max_position_embeddings"]
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(correction_dim(scaling.get("beta_fast", 32)), 0)
    high = min(correction_dim(scaling.get("beta_slow", 1)), dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    original_periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    scaled_periods = scaling["factor"] * original_periods
    return 1.0 / (extrapolation / original_periods + (1.0 - extrapolation) / scaled_periods)


class Model(upstream.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        scaling = args.rope_scaling or {}
        if scaling.get("rope_type") == "yarn" and scaling.get("truncate") is False:
            periods = unrounded_yarn_periods(args.head_dim, args.rope_theta, scaling)
            for layer in self.model.layers:
                layer.self_attn.rope._freqs = periods
        for layer in self.model.layers:
            layer.mlp.experts.activation._limit = args.swiglu_limit
