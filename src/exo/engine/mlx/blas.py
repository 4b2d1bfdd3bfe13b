"""An optimized BLAS under MLX's Linux CPU build.

MLX's Linux wheels link netlib's reference BLAS, whose sgemm multiplies one row at a
time: on this project's 2-core x86 machine a (64 x 1536) @ (1536 x 1856) float32 matmul
took 46 ms, and every extra row of a batch or a speculative verify cost as much as the
first. OpenBLAS (the cmeel-openblas wheel) does it in under 1 ms. Loaded with
RTLD_GLOBAL before libmlx.so, its cblas_* symbols come first in the process's global
scope, so libmlx.so's calls bind to them; MLX itself is unchanged.

The price: OpenBLAS picks kernels by shape, so a row's result can differ in the last
bits between a batch and a single row (netlib's sums in one order for every shape).
EXO_MLX_BLAS=bundled keeps MLX's own; OPENBLAS_NUM_THREADS sets its threads (one by
default)."""

import ctypes
import os
import sys
from importlib.metadata import PackageNotFoundError, distribution

from loguru import logger

OPENBLAS_FILE = "cmeel.prefix/lib/libopenblas.so.0"


def openblas_path() -> str | None:
    try:
        path = distribution("cmeel-openblas").locate_file(OPENBLAS_FILE)
    except PackageNotFoundError:
        return None
    return str(path) if os.path.exists(str(path)) else None


def use_optimized_blas() -> str | None:
    """Load OpenBLAS for MLX to use, where it can still take effect (Linux, MLX not loaded
    yet, not turned off). Returns the library's path when loaded."""
    if sys.platform != "linux" or os.environ.get("EXO_MLX_BLAS") == "bundled":
        return None
    if "mlx.core" in sys.modules:
        return None  # libmlx.so bound its symbols already
    path = openblas_path()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as error:  # e.g. no libgfortran on the machine
        logger.warning(f"MLX keeps its reference BLAS: could not load OpenBLAS ({error})")
        return None
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        # One thread: OpenBLAS's workers spin between calls, and beside MLX's threads, a
        # node's other runners or a busy machine they starve everyone (a one-row
        # 2048x2048 matmul took 182 ms with 2 threads on 2 loaded cores, 3 ms with one).
        library.openblas_set_num_threads(1)
    return path
