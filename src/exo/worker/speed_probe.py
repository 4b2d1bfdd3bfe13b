"""How fast this node computes, measured once: a float32 matmul's GFLOP/s (what a prompt's
prefill is bound by) and a one-row matmul's GB/s of weights read (what decode is bound
by), on MLX's default device with the threads the node's engine runs.

Placement turns these into a model's prefill and decode tok/s to decide where prefill
and decode go (master/disaggregation.py). Measured in a child process at low priority,
after the node is up: the node process never loads MLX, and a node's start (and a
restart's time to serving) does not wait for it. On a llama.cpp node MLX's matmul stands
in for ggml's, run with llama.cpp's thread count."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType

from loguru import logger

from exo.engine.llamacpp.cores import threads as llamacpp_threads
from exo.shared.types.instances import EngineKind
from exo.shared.types.nodes import NodeSpeed

PROBE_TIMEOUT_S = 120
# Each measurement grows its operands until one run takes this long, so a GPU (microseconds
# for a CPU's size) and a slow CPU are both timed on work that hides the call's overhead.
MIN_RUN_S = 0.05
MAX_MATMUL_SIDE = 8192
MAX_MATVEC_BYTES = 1 << 29


def probe_speed(engine: EngineKind) -> NodeSpeed | None:
    """This node's speeds from a child process; None (and a warning) where it fails.
    EXO_SPEED_PROBE=0 turns it off."""
    if os.environ.get("EXO_SPEED_PROBE") == "0":
        return None
    env = dict(os.environ)
    if engine == EngineKind.LlamaCpp and "OPENBLAS_NUM_THREADS" not in env:
        env["OPENBLAS_NUM_THREADS"] = str(llamacpp_threads())
    command = [sys.executable, "-m", "exo.worker.speed_probe"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=env, preexec_fn=_low_priority
        )
        return NodeSpeed.model_validate_json(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError) as error:
        logger.warning(f"could not measure this node's speed: {error}")
        return None


def _low_priority() -> None:
    os.nice(19)


def measure() -> NodeSpeed:
    from exo.engine.mlx.blas import use_optimized_blas

    use_optimized_blas()  # before MLX loads, as in a runner
    import mlx.core as mx

    gflops = _grow(lambda side: _matmul_seconds(mx, side), start=256, limit=MAX_MATMUL_SIDE, work=lambda s: 2 * s**3)
    gbps = _grow(
        lambda side: _matvec_seconds(mx, side), start=1024, limit=_side(MAX_MATVEC_BYTES), work=lambda s: 4 * s * s
    )
    threads = int(os.environ["OPENBLAS_NUM_THREADS"]) if "OPENBLAS_NUM_THREADS" in os.environ else None
    return NodeSpeed(
        matmul_gflops=round(gflops / 1e9, 2),
        matvec_gbps=round(gbps / 1e9, 2),
        device=str(mx.default_device()),
        threads=threads,
    )


def _grow(seconds_for: Callable[[int], float], start: int, limit: int, work: Callable[[int], float]) -> float:
    """Work per second at the first size (doubling from `start`) whose run takes
    MIN_RUN_S, or at `limit`."""
    side = start
    while True:
        elapsed = seconds_for(side)
        if elapsed >= MIN_RUN_S or side * 2 > limit:
            return work(side) / elapsed
        side *= 2


def _side(n_bytes: int) -> int:
    return int((n_bytes / 4) ** 0.5)


def _matmul_seconds(mx: ModuleType, side: int) -> float:
    a = mx.random.normal((side, side))
    b = mx.random.normal((side, side))
    mx.eval(a, b, a @ b)  # warm: kernels chosen, buffers allocated
    return _best_of(lambda: mx.eval(a @ b))


def _matvec_seconds(mx: ModuleType, side: int) -> float:
    weights = mx.random.normal((side, side))
    row = mx.random.normal((1, side))
    mx.eval(weights, row, row @ weights)
    return _best_of(lambda: mx.eval(row @ weights))


def _best_of(run: Callable[[], object], times: int = 3) -> float:
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    print(json.dumps(measure().model_dump()))
