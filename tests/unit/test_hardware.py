"""--engine auto: MLX where it has a GPU, llama.cpp elsewhere (worker/hardware.py).

The GPU cases are described, not probed: this machine has no GPU. The probe itself is
checked on this machine, and a real node started with the default says what it chose."""

from pathlib import Path

import pytest

from exo.shared.types.instances import EngineKind
from exo.worker.hardware import Hardware, choose_engine, mlx_backend, probe
from tests.support.node import running_node


def hardware(
    system: str = "Linux",
    machine: str = "x86_64",
    nvidia_gpu: bool = False,
    mlx_cuda: bool = False,
    llama_cpp: bool = True,
) -> Hardware:
    return Hardware(system=system, machine=machine, nvidia_gpu=nvidia_gpu, mlx_cuda=mlx_cuda, llama_cpp=llama_cpp)


@pytest.mark.parametrize(
    ("machine", "engine", "backend", "why"),
    [
        (hardware(), EngineKind.LlamaCpp, "cpu", "no GPU MLX can use"),
        (hardware(system="Darwin", machine="arm64"), EngineKind.Mlx, "metal", "MLX has a GPU here (metal)"),
        (hardware(nvidia_gpu=True, mlx_cuda=True), EngineKind.Mlx, "cuda", "MLX has a GPU here (cuda)"),
        (hardware(nvidia_gpu=True), EngineKind.LlamaCpp, "cpu", "MLX's CUDA backend does not see it"),
        (hardware(llama_cpp=False), EngineKind.Mlx, "cpu", "llama-cpp-python is not installed"),
        # An Intel Mac: no Metal for MLX, so llama.cpp.
        (hardware(system="Darwin", machine="x86_64"), EngineKind.LlamaCpp, "cpu", "no GPU MLX can use"),
    ],
)
def test_auto_picks_mlx_only_where_it_has_a_gpu(machine: Hardware, engine: EngineKind, backend: str, why: str) -> None:
    chosen, reason = choose_engine("auto", machine)
    assert chosen == engine
    assert why in reason
    assert mlx_backend(machine) == backend


def test_an_explicit_engine_is_kept_whatever_the_hardware() -> None:
    assert choose_engine("mlx", hardware()) == (EngineKind.Mlx, "--engine mlx")
    assert choose_engine("llamacpp", hardware(system="Darwin", machine="arm64"))[0] == EngineKind.LlamaCpp


def test_this_machine_has_no_gpu_and_has_llama_cpp() -> None:
    found = probe()
    assert not found.nvidia_gpu and not found.mlx_cuda
    assert found.llama_cpp
    assert mlx_backend(found) == "cpu"


def test_a_node_started_with_the_default_engine_says_what_it_chose(tmp_path: Path) -> None:
    with running_node(tmp_path / "home") as exo:
        state = exo.wait_for_state(lambda s: s["nodes"], what="the node's info")
        logs = exo.logs()
    (info,) = state["nodes"].values()
    assert (info["engine"], info["backend"]) == ("llamacpp", "cpu")
    assert "engine: llamacpp (no GPU MLX can use: llama.cpp on the CPU)" in logs
