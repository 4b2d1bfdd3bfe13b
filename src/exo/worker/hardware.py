"""What this machine computes on, for `--engine auto` and NodeInfo.backend, found without
loading MLX or llama.cpp into the node process.

MLX is fast where it has a GPU: Metal on Apple silicon, CUDA where MLX's CUDA build
(scripts/setup.sh installs it) sees an NVIDIA GPU. Elsewhere it has only its CPU backend,
whose kernels reach a few GB/s of the memory bus, and llama.cpp's CPU kernels are tens of
times faster (docs/engines.md), so auto takes llama.cpp there when it is installed."""

import functools
import importlib.util
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from exo.shared.types.instances import EngineKind
from exo.shared.types.nodes import GpuInfo

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
# Asked in a child so the node process never loads MLX (its import alone is ~200 MB).
CUDA_PROBE = "import mlx.core as mx; print(mx.cuda.is_available())"
CUDA_PROBE_TIMEOUT_S = 60
GPU_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"]
# Asked every few seconds for NodeInfo; a wedged driver must not hold the report up.
GPU_QUERY_TIMEOUT_S = 5
MIB = 2**20


@dataclass(frozen=True)
class Hardware:
    system: str  # platform.system()
    machine: str  # platform.machine()
    nvidia_gpu: bool  # the NVIDIA driver lists a GPU
    mlx_cuda: bool  # MLX's CUDA backend is installed and sees that GPU
    llama_cpp: bool  # llama-cpp-python is installed

    @property
    def apple_silicon(self) -> bool:
        return self.system == "Darwin" and self.machine == "arm64"


@functools.cache
def probe() -> Hardware:
    nvidia_gpu = NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())
    return Hardware(
        system=platform.system(),
        machine=platform.machine(),
        nvidia_gpu=nvidia_gpu,
        mlx_cuda=nvidia_gpu and _mlx_sees_cuda(),
        llama_cpp=importlib.util.find_spec("llama_cpp") is not None,
    )


def _mlx_sees_cuda() -> bool:
    try:
        done = subprocess.run(
            [sys.executable, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=CUDA_PROBE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning(f"could not ask MLX whether it sees the NVIDIA GPU: {error}")
        return False
    return done.returncode == 0 and done.stdout.strip() == "True"


def nvidia_gpus(hardware: Hardware) -> list[GpuInfo]:
    """The NVIDIA GPUs' names and memory from nvidia-smi, which answers without a CUDA
    context (MLX is never loaded here); empty where the driver lists no GPU or nvidia-smi
    does not answer."""
    if not hardware.nvidia_gpu:
        return []
    try:
        done = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        _warn_once(f"could not ask nvidia-smi for the GPUs' memory: {error}")
        return []
    if done.returncode != 0:
        _warn_once(f"nvidia-smi failed (exit code {done.returncode}): {done.stderr.strip()[:200]}")
        return []
    return parse_gpu_query(done.stdout)


def parse_gpu_query(output: str) -> list[GpuInfo]:
    """GPU_QUERY's lines, "name, total MiB, free MiB"; a line that does not read so (a
    value "[N/A]", an error) is left out."""
    gpus = []
    for line in output.splitlines():
        fields = [field.strip() for field in line.rsplit(",", 2)]
        if len(fields) != 3 or not fields[0] or not fields[1].isdigit() or not fields[2].isdigit():
            continue
        name, total_mib, free_mib = fields
        gpus.append(GpuInfo(name=name, total_bytes=int(total_mib) * MIB, free_bytes=int(free_mib) * MIB))
    return gpus


@functools.cache
def _warn_once(message: str) -> None:
    """NodeInfo is gathered every few seconds: say what is wrong once, not each time."""
    logger.warning(message)


def mlx_backend(hardware: Hardware) -> str:
    """What MLX computes on here: "metal", "cuda" or "cpu"."""
    if hardware.apple_silicon:
        return "metal"
    return "cuda" if hardware.mlx_cuda else "cpu"


def choose_engine(choice: str, hardware: Hardware) -> tuple[EngineKind, str]:
    """The engine `--engine choice` means on this hardware, and why (for the start-up log)."""
    if choice != "auto":
        return EngineKind(choice), f"--engine {choice}"
    backend = mlx_backend(hardware)
    if backend != "cpu":
        return EngineKind.Mlx, f"MLX has a GPU here ({backend})"
    if not hardware.llama_cpp:
        return EngineKind.Mlx, "llama-cpp-python is not installed: MLX on the CPU"
    if hardware.nvidia_gpu:
        return EngineKind.LlamaCpp, (
            "an NVIDIA GPU is present but MLX's CUDA backend does not see it "
            "(scripts/setup.sh installs the build for this driver, or says why not): llama.cpp on the CPU"
        )
    return EngineKind.LlamaCpp, "no GPU MLX can use: llama.cpp on the CPU"
