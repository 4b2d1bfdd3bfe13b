"""MLX's Linux CPU build runs its matmuls on OpenBLAS in a runner (engine/mlx/blas.py):
a fresh interpreter imports what a runner imports, in the runner's order, and must have
OpenBLAS mapped before MLX; EXO_MLX_BLAS=bundled keeps MLX's reference BLAS."""

import os
import subprocess
import sys

import pytest

from exo.engine.mlx.blas import OPENBLAS_FILE

PROBE = """
import exo.worker.runner  # what the runner process has before its engine
import exo.engine.mlx.engine
import mlx.core as mx
mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
print(any({file!r} in line for line in open("/proc/self/maps")))
"""


def _maps_openblas(env_extra: dict[str, str]) -> bool:
    env = {**os.environ, **env_extra}
    probe = PROBE.format(file=OPENBLAS_FILE)
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.skipif(sys.platform != "linux", reason="MLX's Linux build only: macOS has Accelerate")
def test_a_runner_puts_openblas_under_mlx():
    assert _maps_openblas({"EXO_MLX_BLAS": ""})


@pytest.mark.skipif(sys.platform != "linux", reason="MLX's Linux build only: macOS has Accelerate")
def test_bundled_keeps_mlx_reference_blas():
    assert not _maps_openblas({"EXO_MLX_BLAS": "bundled"})
