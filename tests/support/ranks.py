"""Running the ranks of a split model as real processes on loopback: each rank is
`exo.devtools.parallel_check` (the engine's own loading and sharding, the MLX ring over
127.0.0.1) in a process of its own, with exo's model modules registered and torch kept
out as in a runner."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

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
    """Starts every rank at once, waits for all, and returns what each recorded
    (parallel_check's npz); a rank that fails fails the test with its output."""
    hosts = ",".join(f"127.0.0.1:{port}" for port in free_ports(world_size))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    procs = []
    for rank in range(world_size):
        cmd = [
            sys.executable, "-c", RANK_LAUNCHER, str(model_dir), str(out_dir / f"{sharding}{rank}.npz"),
            "--sharding", sharding, "--world-size", str(world_size), "--rank", str(rank), "--hosts", hosts,
            "--prompt", json.dumps(prompt), *extra_args,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env))
    try:
        outputs = [proc.communicate(timeout=timeout_s)[0].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank][-3000:]}"
    return [dict(np.load(out_dir / f"{sharding}{rank}.npz")) for rank in range(world_size)]
