"""The MLX engine. Importing the package first puts an optimized BLAS under MLX's CPU
build (blas.py), before any of its modules loads MLX."""

from exo.engine.mlx.blas import use_optimized_blas

use_optimized_blas()
