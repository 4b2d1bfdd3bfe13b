"""Model architectures mlx-lm lacks (or computes differently from the reference),
written as mlx-lm model modules.

Importing this package makes each one importable as `mlx_lm.models.<model_type>`, so
mlx-lm's own loading (`load_model`, `_get_classes`) and cache helpers
(`make_prompt_cache`) find it like any architecture it ships."""

import sys

from exo.engine.mlx.models import deepseek_v4, gpt_oss, kimi_vl

sys.modules["mlx_lm.models.deepseek_v4"] = deepseek_v4
sys.modules["mlx_lm.models.gpt_oss"] = gpt_oss
sys.modules["mlx_lm.models.kimi_vl"] = kimi_vl
