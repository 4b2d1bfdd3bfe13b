"""What scripts/setup.sh installs on each kind of machine (scripts/mlx_build.py decides).

The machines are described: this one has no GPU. The choice is checked as a function, and
setup.sh itself runs in its dry-run mode on a copy of the repository's setup files, with a
fake `nvidia-smi` first on PATH, so nothing is installed."""

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
LLAMA_CPP = "llama-cpp-python"


def load_mlx_build() -> ModuleType:
    # scripts/ is not a package: load the file as setup.sh runs it.
    spec = importlib.util.spec_from_file_location("mlx_build", REPO / "scripts" / "mlx_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mlx_build = load_mlx_build()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def nvidia_smi_header(cuda: str) -> str:
    return (
        "+-----------------------------------------------------------------------------------------+\n"
        f"| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      CUDA Version: {cuda}     |\n"
        "|-----------------------------------------+------------------------+----------------------+\n"
    )


NO_DRIVER_LOADED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


@pytest.mark.parametrize(
    ("system", "machine", "nvidia_smi", "requirement", "why"),
    [
        ("Darwin", "arm64", None, "mlx", "Apple silicon: MLX on Metal"),
        ("Linux", "x86_64", None, "mlx[cpu]", "no NVIDIA driver"),
        ("Linux", "x86_64", nvidia_smi_header("13.0"), "mlx[cuda13]", "no llama.cpp build"),
        ("Linux", "x86_64", nvidia_smi_header("12.8"), "mlx[cuda12]", "CUDA 12.8: MLX's CUDA 12 build"),
        ("Linux", "x86_64", nvidia_smi_header("12.4"), "mlx[cuda12]", "CUDA 12.4"),
        # A newer driver runs the newest build there is.
        ("Linux", "x86_64", nvidia_smi_header("14.1"), "mlx[cuda13]", "MLX's CUDA 13 build"),
        # mlx-cuda-12 and -13 publish aarch64 wheels too (Grace Hopper, DGX Spark).
        ("Linux", "aarch64", nvidia_smi_header("13.0"), "mlx[cuda13]", "MLX's CUDA 13 build"),
        ("Linux", "aarch64", nvidia_smi_header("12.6"), "mlx[cuda12]", "MLX's CUDA 12 build"),
        # Too old for MLX's CUDA builds (driver 550.54.14, CUDA 12.4, at least): said, and the CPU path.
        ("Linux", "x86_64", nvidia_smi_header("11.8"), "mlx[cpu]", "CUDA 11.8, and MLX's CUDA builds need 12.4"),
        ("Linux", "x86_64", nvidia_smi_header("12.2"), "mlx[cpu]", "Update the driver"),
        ("Linux", "x86_64", NO_DRIVER_LOADED, "mlx[cpu]", "nvidia-smi names no CUDA version"),
        ("Linux", "ppc64le", nvidia_smi_header("13.0"), "mlx[cpu]", "not ppc64le"),
    ],
)
def test_mlx_build_for_machine(system: str, machine: str, nvidia_smi: str | None, requirement: str, why: str) -> None:
    chosen, reason = mlx_build.mlx_requirement(system, machine, nvidia_smi)
    assert chosen == requirement
    assert why in reason


def test_cpu_build_installs_what_pyproject_names() -> None:
    assert mlx_build.exo_requirements(PYPROJECT, "mlx[cpu]", test=False) == PYPROJECT["project"]["dependencies"]
    assert mlx_build.exo_requirements(PYPROJECT, "mlx[cpu]", test=True) == (
        PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["test"]
    )
    # macOS's line (for pip to pick by its marker there) names no extra and stays.
    assert "mlx>=0.29; sys_platform == 'darwin'" in mlx_build.exo_requirements(PYPROJECT, "mlx", test=False)


def test_cuda_build_takes_the_cpu_builds_place_and_drops_llama_cpp() -> None:
    requirements = mlx_build.exo_requirements(PYPROJECT, "mlx[cuda13]", test=False)
    names = [mlx_build.distribution_name(requirement) for requirement in requirements]
    assert LLAMA_CPP not in names
    assert "mlx[cuda13]>=0.29; sys_platform == 'linux'" in requirements
    assert not any("mlx[cpu]" in requirement for requirement in requirements)
    # Everything else pyproject names is still there.
    expected = [
        mlx_build.distribution_name(dependency)
        for dependency in PYPROJECT["project"]["dependencies"]
        if mlx_build.distribution_name(dependency) != LLAMA_CPP
    ]
    assert names == expected


FAKE_VENV_PYTHON = """#!/bin/sh
# A venv set up before the driver came: it holds MLX's CPU build.
if [ "$1 $2 $3" = "-m pip show" ]; then
  [ "$5" = mlx-cpu ]
  exit
fi
exec {python} "$@"
"""


def dry_run(
    tmp_path: Path, nvidia_smi: str, *, mode: str = "runtime", env: dict[str, str] | None = None, venv: bool = False
) -> subprocess.CompletedProcess[str]:
    """`EXO_SETUP_DRY_RUN=1 bash scripts/setup.sh MODE` in a copy of the setup files, with
    an `nvidia-smi` that prints `nvidia_smi` (and fails where it names no CUDA version)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "scripts/mlx_build.py", "pyproject.toml"):
        (repo / name).write_text((REPO / name).read_text())
    if venv:
        python = repo / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE_VENV_PYTHON.format(python=sys.executable))
        python.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    failing = "CUDA Version" not in nvidia_smi
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{nvidia_smi}EOF\nexit {9 if failing else 0}\n")
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh"), mode],
        env={
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHON": sys.executable,
            "EXO_SETUP_DRY_RUN": "1",
            # No llama.cpp wheel cached: the CPU path shows its build.
            "XDG_CACHE_HOME": str(tmp_path / "cache"),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert not (repo / ".venv").exists() or venv, "a dry run made the venv"
    assert not list((repo / ".venv").glob(".exo-installed-*")), "a dry run wrote the stamp"
    return done


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="setup.sh's Linux paths")


@linux_only
def test_setup_on_a_cuda_13_driver_installs_mlx_cuda_13_and_builds_no_llama_cpp(tmp_path: Path) -> None:
    done = dry_run(tmp_path, nvidia_smi_header("13.0"), mode="test", venv=True)
    assert "MLX's CUDA 13 build, no llama.cpp build" in done.stderr
    installs = [line for line in done.stdout.splitlines() if line.startswith("+ .venv/bin/python -m pip install")]
    assert any("\"mlx[cuda13]>=0.29; sys_platform == 'linux'\"" in line for line in installs), done.stdout
    assert "torch==2.13.0" in done.stdout  # the test extras
    assert "mlx[cpu]" not in done.stdout
    assert LLAMA_CPP not in done.stdout
    assert "pip wheel" not in done.stdout
    # The CPU build the venv held goes first: both write mlx/lib/libmlx.so.
    assert "+ .venv/bin/python -m pip uninstall --quiet --yes mlx-cpu" in done.stdout
    assert done.stdout.index("pip uninstall") < done.stdout.index("mlx[cuda13]")
    assert done.stdout.splitlines()[-1] == "+ .venv/bin/python -m pip install --quiet --no-deps -e ."


@linux_only
@pytest.mark.parametrize(
    ("nvidia_smi", "why"),
    [
        (nvidia_smi_header("11.8"), "supports CUDA 11.8, and MLX's CUDA builds need 12.4 or newer"),
        (NO_DRIVER_LOADED, "nvidia-smi names no CUDA version"),
    ],
)
def test_setup_without_a_usable_driver_builds_llama_cpp(tmp_path: Path, nvidia_smi: str, why: str) -> None:
    done = dry_run(tmp_path, nvidia_smi)
    assert why in done.stderr
    assert "building llama-cpp-python" in done.stderr
    assert f"pip wheel --quiet --no-deps --no-cache-dir -w {tmp_path}/cache/exo/wheels/llama-cpp-" in done.stdout
    assert "\"mlx[cpu]>=0.29; sys_platform == 'linux'\"" in done.stdout
    assert "mlx[cuda" not in done.stdout
    assert f"+ {sys.executable} -m venv .venv" in done.stdout


@linux_only
@pytest.mark.parametrize("nvidia_smi", [nvidia_smi_header("12.8"), NO_DRIVER_LOADED])
def test_setup_from_a_wheelhouse_installs_only_from_it(tmp_path: Path, nvidia_smi: str) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").touch()
    done = dry_run(tmp_path, nvidia_smi, env={"EXO_WHEELHOUSE": str(wheelhouse)})
    installs = [line for line in done.stdout.splitlines() if " -m pip install " in line]
    assert installs
    for line in installs:
        assert f" --no-index --find-links {wheelhouse} " in line, line
    # llama.cpp's wheel from the wheelhouse, never a build.
    assert "pip wheel" not in done.stdout
    cuda = "CUDA Version" in nvidia_smi
    assert (f"--find-links {wheelhouse} {LLAMA_CPP}==0.3.36" in done.stdout) != cuda
    assert ("mlx[cuda12]" in done.stdout) == cuda
