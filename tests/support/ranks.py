"""Running the ranks of a split model as real processes on loopback: each rank is
`exo.devtools.parallel_check` (the engine's own loading and sharding, the MLX ring over
127.0.0.1) in a process of its own, with exo's model modules registered and torch kept
out as in a runner."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

# The ranks import transformers only for the tokenizer; blocking torch (as on a Mac with
# just MLX) halves each rank's start-up time.
RANK_LAUNCHER = (
    "import runpy, sys; sys.modules['torch'] = None; import exo.engine.mlx.models; "
    "runpy.run_module('exo.devtools.parallel_check', run_name='__main__', alter_sys=True)"
)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_ranks(
    model_dir: Path,
    out_dir: Path,
    sharding: str,
    world_size: int,
    prompt: list[int],
    extra_args: list[str],
    timeout_s: float = 240,
) -> list[dict[str, np.ndarray]]:
    """Starts every rank at once and returns what each recorded (parallel_check's npz).
    The first rank to fail kills the rest (a rank waiting on a dead peer would otherwise
    hang until the timeout) and fails the test with every rank's output."""
    hosts = ",".join(f"127.0.0.1:{port}" for port in free_ports(world_size))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    # The ranks' own temporary directory: what a rank leaves there is a leak.
    scratch = Path(tempfile.mkdtemp(prefix=f"{sharding}-tmp-", dir=out_dir))
    # Where MLX keeps the CPU kernels it compiles, shared so no rank compiles them again.
    mlx_kernels = Path(tempfile.gettempdir()) / "mlx"
    mlx_kernels.mkdir(exist_ok=True)
    (scratch / "mlx").symlink_to(mlx_kernels)
    env["TMPDIR"] = str(scratch)
    procs, logs = [], []
    for rank in range(world_size):
        log = open(out_dir / f"{sharding}{rank}.log", "w+")  # noqa: SIM115  (closed below)
        logs.append(log)
        cmd = [
            sys.executable, "-c", RANK_LAUNCHER, str(model_dir), str(out_dir / f"{sharding}{rank}.npz"),
            "--sharding", sharding, "--world-size", str(world_size), "--rank", str(rank), "--hosts", hosts,
            "--prompt", json.dumps(prompt), *extra_args,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    failure = None
    deadline = time.monotonic() + timeout_s
    try:
        while failure is None and any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline:
                failure = f"ranks still running after {timeout_s:.0f}s"
            time.sleep(0.1)
            failure = failure or _first_failure(procs)
        failure = failure or _first_failure(procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    if failure:
        tails = "\n".join(f"--- rank {rank} ---\n{output[-3000:]}" for rank, output in enumerate(outputs))
        pytest.fail(f"{sharding} x{world_size}: {failure}\n{tails}")
    # Joining the ring writes a hostfile for MLX, which must be gone once the ring is up.
    left = sorted(path.name for path in scratch.iterdir() if path.name != "mlx")
    assert not left, f"the ranks left {left} in their temporary directory"
    return [dict(np.load(out_dir / f"{sharding}{rank}.npz")) for rank in range(world_size)]


def _first_failure(procs: list[subprocess.Popen]) -> str | None:
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode not in (None, 0)]
    return f"rank {failed[0]} exited with {procs[failed[0]].returncode}" if failed else None
