"""The GPU memory a benchmark target takes as the device sees it. MLX's peak
(`mx.get_peak_memory`, which exo reports) counts the arrays in use; the GPU also holds
the buffers MLX's cache keeps for reuse, CUDA's context and its libraries' workspaces.
A user reads nvidia-smi, so exo-bench does too: the NVIDIA GPUs' free memory, sampled
in a thread while a target runs, against what was free when it opened."""

import threading
from collections.abc import Callable

from exo.shared.types.nodes import GpuInfo
from exo.worker.hardware import nvidia_gpus, probe

# nvidia-smi answers in about 50 ms; a peak shorter than this can go unseen.
INTERVAL_S = 0.2


def _gpus_here() -> list[GpuInfo]:
    return nvidia_gpus(probe())


class DeviceMemoryWatch:
    """`taken_bytes`: the most memory the GPUs lost while open, beyond what was already
    in use when opened (their total over every GPU); None where no NVIDIA GPU answers."""

    def __init__(self, gpus: Callable[[], list[GpuInfo]] = _gpus_here, interval_s: float = INTERVAL_S) -> None:
        self._gpus = gpus
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._free_at_start = 0
        self._least_free: int | None = None
        self.taken_bytes: int | None = None

    def _free(self) -> int | None:
        gpus = self._gpus()
        return sum(gpu.free_bytes for gpu in gpus) if gpus else None

    def _sample(self) -> None:
        free = self._free()
        if free is not None and (self._least_free is None or free < self._least_free):
            self._least_free = free

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def __enter__(self) -> "DeviceMemoryWatch":
        free = self._free()
        if free is not None:
            self._free_at_start = self._least_free = free
            self._thread = threading.Thread(target=self._run, name="device-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        assert self._least_free is not None
        self.taken_bytes = max(0, self._free_at_start - self._least_free)
