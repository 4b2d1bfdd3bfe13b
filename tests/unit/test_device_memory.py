"""exo-bench's GPU memory figure: what the GPUs lost while a target ran (nvidia-smi), and
its ratio to the weights plus the requests' KV. nvidia-smi itself is scripted here (this
machine has no NVIDIA GPU); its parsing is tested in test_gpu_memory.py."""

import threading

from exo.devtools.device_memory import DeviceMemoryWatch
from exo.devtools.exo_bench import ratios
from exo.shared.types.nodes import GpuInfo

GIB = 1 << 30


class ScriptedGpus:
    """Answers each query with the next of `free` (GiB free on each GPU), then the last
    again; `done` is set once every answer was given."""

    def __init__(self, free: list[tuple[int, ...]]) -> None:
        self.free = free
        self.asked = 0
        self.done = threading.Event()

    def __call__(self) -> list[GpuInfo]:
        answer = self.free[min(self.asked, len(self.free) - 1)]
        self.asked += 1
        if self.asked >= len(self.free):
            self.done.set()
        return [GpuInfo(name=f"gpu{i}", total_bytes=141 * GIB, free_bytes=f * GIB) for i, f in enumerate(answer)]


def test_the_most_taken_while_open_counts_over_every_gpu():
    gpus = ScriptedGpus([(100, 90), (80, 90), (40, 85), (70, 60), (95, 90)])
    with DeviceMemoryWatch(gpus, interval_s=0.001) as watch:
        assert gpus.done.wait(5)
    # 190 GiB free at the start; the least free at one sample is 40 + 85 GiB.
    assert watch.taken_bytes == 190 * GIB - 125 * GIB


def test_memory_already_in_use_when_opened_is_not_counted():
    gpus = ScriptedGpus([(50,), (50,), (51,)])
    with DeviceMemoryWatch(gpus, interval_s=0.001) as watch:
        assert gpus.done.wait(5)
    assert watch.taken_bytes == 0


def test_no_gpu_no_figure():
    with DeviceMemoryWatch(lambda: [], interval_s=0.001) as watch:
        pass
    assert watch.taken_bytes is None


def _row(concurrency: int, need: int, taken: int | None) -> dict:
    row = {
        "target": "exo single",
        "pp": 4096,
        "tg": 16,
        "concurrency": concurrency,
        "prefix_cache": "on",
        "aggregate_tps": 10.0,
        "ttft_s": 1.0,
        "texts": [],
        "rounds": [{"peak_memory_bytes": 12 * GIB}],
        "weights_and_kv_bytes": need,
    }
    if taken is not None:
        row["gpu_memory_taken_bytes"] = taken
    return row


def test_gpu_memory_taken_is_set_against_the_largest_cells_weights_and_kv():
    found = ratios([_row(1, 4 * GIB, 20 * GIB), _row(16, 10 * GIB, 20 * GIB)])
    by_what = {entry["what"]: entry for entry in found if "ratio" in entry}
    taken = by_what["exo single: GPU memory taken (nvidia-smi) / (weights + the requests' KV)"]
    assert taken["ratio"] == 2.0 and "c=16" in taken["cell"]
    assert by_what["exo single: peak memory / (weights + the requests' KV)"]["ratio"] == 1.2


def test_no_gpu_figure_without_nvidia_smi():
    found = ratios([_row(16, 10 * GIB, None)])
    assert not [entry for entry in found if "nvidia-smi" in entry["what"]]
