"""Tools for building test models and measuring exo. Importing the package first puts
OpenBLAS under MLX (engine/mlx/blas.py) before any tool loads MLX, so what a tool runs
in its own process (raw mlx-lm beside exo's engine) computes as exo's runners do."""

from exo.engine.mlx.blas import use_optimized_blas

use_optimized_blas()
