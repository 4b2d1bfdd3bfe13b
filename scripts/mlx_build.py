"""Which MLX build scripts/setup.sh installs on this machine, and exo's requirements with it.

    python scripts/mlx_build.py                                 the pip requirement, a tab, why
    python scripts/mlx_build.py requirements MLX runtime|test   exo's dependencies (test: and its
                                                                test extras) with that MLX build

Stdlib only: setup.sh runs it before the venv has anything in it.

MLX's CUDA builds (mlx-cuda-12, mlx-cuda-13 on PyPI, manylinux_2_35 wheels for x86_64 and
aarch64) bring their own CUDA libraries, so all they need of the machine is a driver new
enough for them: 550.54.14 (CUDA 12.4) for the CUDA 12 build, 580 (CUDA 13.0) for the CUDA
13 one. With one of them `--engine auto` runs models on MLX, so llama.cpp is not built."""

import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

CUDA_12_MINIMUM = (12, 4)
CUDA_WHEEL_MACHINES = ("x86_64", "aarch64")
NVIDIA_SMI_TIMEOUT_S = 60
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def driver_cuda_version(nvidia_smi_output: str) -> tuple[int, int] | None:
    """The CUDA version the driver supports, from nvidia-smi's header ("CUDA Version: 13.0")."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi_output)
    return (int(found[1]), int(found[2])) if found else None


def mlx_requirement(system: str, machine: str, nvidia_smi_output: str | None) -> tuple[str, str]:
    """The MLX requirement for a machine (platform.system(), platform.machine(), what
    `nvidia-smi` printed or None where there is none), and why, for the person installing."""
    if system == "Darwin":
        if machine == "arm64":
            return "mlx", "Apple silicon: MLX on Metal"
        return "mlx", f"macOS on {machine}: MLX's Metal backend is for Apple silicon only"
    cpu_build = "mlx[cpu]"
    cpu_path = "MLX's CPU build, and llama.cpp built for the CPU"
    if nvidia_smi_output is None:
        return cpu_build, f"no NVIDIA driver (no nvidia-smi): {cpu_path}"
    version = driver_cuda_version(nvidia_smi_output)
    if version is None:
        return cpu_build, f"nvidia-smi names no CUDA version (no GPU, or the driver is not loaded): {cpu_path}"
    shown = f"{version[0]}.{version[1]}"
    if machine not in CUDA_WHEEL_MACHINES:
        return cpu_build, f"MLX's CUDA builds are for {' and '.join(CUDA_WHEEL_MACHINES)}, not {machine}: {cpu_path}"
    if version < CUDA_12_MINIMUM:
        return cpu_build, (
            f"the NVIDIA driver supports CUDA {shown}, and MLX's CUDA builds need 12.4 or newer "
            f"(driver 550.54.14+; 580+ for CUDA 13): {cpu_path}. Update the driver to run models on the GPU"
        )
    # A newer driver runs older CUDA builds, so a CUDA 14 driver gets the CUDA 13 build.
    major = 13 if version >= (13, 0) else 12
    return f"mlx[cuda{major}]", f"NVIDIA driver for CUDA {shown}: MLX's CUDA {major} build, no llama.cpp build"


def distribution_name(requirement: str) -> str:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if name is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", name[1]).lower()


def exo_requirements(pyproject: dict[str, Any], mlx: str, test: bool) -> list[str]:
    """exo's dependencies from pyproject.toml's [project] table (and its test extras) with
    the MLX build `mlx`. With a CUDA build there is no llama-cpp-python: `--engine auto`
    runs MLX there, and llama.cpp's build takes about 10 minutes."""
    project = pyproject["project"]
    dependencies = project["dependencies"] + (project["optional-dependencies"]["test"] if test else [])
    cuda = mlx.startswith("mlx[cuda")
    chosen: list[str] = []
    for dependency in dependencies:
        name = distribution_name(dependency)
        if cuda and name == "llama-cpp-python":
            continue
        if name == "mlx":
            # pyproject names Linux's MLX by its CPU extra (macOS's has none): the chosen
            # build takes its place, version bound and marker kept.
            dependency = re.sub(r"^\s*mlx\s*\[[^\]]*\]", lambda _: mlx, dependency)
        chosen.append(dependency)
    return chosen


def run_nvidia_smi() -> str | None:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return None
    try:
        done = subprocess.run([executable], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi failed: {error}"
    return done.stdout + done.stderr


def main(arguments: list[str]) -> int:
    if not arguments:
        requirement, why = mlx_requirement(platform.system(), platform.machine(), run_nvidia_smi())
        print(f"{requirement}\t{why}")
        return 0
    if len(arguments) == 3 and arguments[0] == "requirements" and arguments[2] in ("runtime", "test"):
        pyproject = tomllib.loads(PYPROJECT.read_text())
        print("\n".join(exo_requirements(pyproject, arguments[1], test=arguments[2] == "test")))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
