"""What a node tells the cluster about itself."""

from pydantic import Field

from exo.shared.types.common import FrozenModel, ModelId, NodeId
from exo.shared.types.instances import EngineKind
from exo.shared.types.topology import NetworkInterface


class MemoryInfo(FrozenModel):
    total_bytes: int
    available_bytes: int


class GpuInfo(FrozenModel):
    """An NVIDIA GPU as its driver reports it (nvidia-smi)."""

    name: str
    total_bytes: int
    free_bytes: int


class NodeSpeed(FrozenModel):
    """What the node computes at, measured once after it starts (worker/speed_probe.py):
    a float32 matmul's GFLOP/s (prefill's bound) and a one-row matmul's GB/s of weights
    read (decode's), on `device` with `threads` BLAS threads (None: the engine's default)."""

    matmul_gflops: float = Field(gt=0)
    matvec_gbps: float = Field(gt=0)
    device: str
    threads: int | None = None


class NodeInfo(FrozenModel):
    node_id: NodeId
    friendly_name: str
    os: str
    backend: str  # "cpu", "metal" or "cuda": what MLX computes on (worker/hardware.py)
    engine: EngineKind = EngineKind.Mlx  # what this node's runners run models with
    # Its cluster messages are sealed by a cluster secret: a split then stays off
    # llama.cpp's RPC, which the secret does not cover.
    sealed: bool = False
    # Models llama.cpp refused on this node (its loader would not take the converted
    # GGUF, or the converter cannot write the model), with why: their instances run on
    # MLX here, and placement and its preview say so.
    llamacpp_refusals: dict[ModelId, str] = {}
    cpu_count: int
    memory: MemoryInfo
    # The NVIDIA GPUs the driver lists, in its order; MLX's CUDA backend computes on one
    # device, which placement takes to be the first. Empty on Apple silicon: Metal's
    # working set is the unified memory, which `memory` already counts.
    gpus: list[GpuInfo] = []
    disk_available_bytes: int
    api_port: int
    # None until the node has measured it (a few seconds after it starts), or where
    # measuring failed or EXO_SPEED_PROBE=0.
    speed: NodeSpeed | None = None
    interfaces: list[NetworkInterface] = []
