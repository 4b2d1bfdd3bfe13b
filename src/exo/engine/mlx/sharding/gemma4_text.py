"""Text-only Gemma 4 checkpoints (model_type gemma4_text) split like the full model."""

from exo.engine.mlx.sharding.gemma4 import fix_pipeline, shard

__all__ = ["fix_pipeline", "shard"]
