#!/usr/bin/env bash
# Takes exo to an NVIDIA machine that has no network, for bench/gpu.sh from a source
# checkout: a machine with Python 3.12, torch, transformers, numpy, safetensors and
# huggingface_hub (a CUDA image's usual set) but none of exo's other dependencies.
#
#   bash bench/gpu_kit.sh pack [DIR] [PART_MB]   # here, online, with exo set up
#   bash bench/gpu_kit.sh install DIR SITE       # there, with DIR's files copied over
#   PYTHONPATH=SITE:src PYTHON=python3 bash bench/gpu.sh OUT
#
# pack fills DIR (default gpu-kit) with the wheels the machine lacks, at the versions of
# this checkout's .venv, for CPython 3.12 on manylinux x86_64, and MLX's CUDA 13 build
# (its wheel is 90 MB): unpacked, its library stripped of symbols, xz'd (about 74 MB) and
# split into parts of PART_MB (default 50) for copies limited in size: 50 and 24 MB, and
# 26 MB of wheels. install puts the wheels into SITE (pip --target, no index, no
# dependencies) and the CUDA build over them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# What such a machine lacks of exo's runtime dependencies (it has Pillow, psutil, Jinja
# and the like): not llama.cpp (MLX's CUDA build serves there), nor OpenBLAS
# (engine/mlx/blas.py goes on without it).
KIT_PACKAGES=(
  mlx mlx-lm mlx-vlm llguidance gguf loguru eclipse-zenoh cryptography cffi pycparser fastapi
  starlette uvicorn pydantic pydantic-core annotated-types annotated-doc typing-inspection
  typing-extensions opentelemetry-api
)
PY_VERSION=3.12
PLATFORMS=(manylinux_2_17_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_35_x86_64)

pack() {
  local dir=${1:-gpu-kit} part_mb=${2:-50}
  local python=$root/.venv/bin/python
  [ -x "$python" ] || { echo "pack reads the versions of $root/.venv: run scripts/setup.sh first" >&2; exit 1; }
  # Only what an earlier pack wrote goes: DIR may be a directory that holds other things.
  rm -rf "$dir/wheels" "$dir"/mlx-cuda.tar.xz.part-* && mkdir -p "$dir/wheels"
  version_of() { "$python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }
  local pins=() name
  for name in "${KIT_PACKAGES[@]}"; do pins+=("$name==$(version_of "$name")"); done
  local platform_args=()
  for name in "${PLATFORMS[@]}"; do platform_args+=(--platform "$name"); done
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    "${platform_args[@]}" -d "$dir/wheels" "${pins[@]}"
  local scratch
  scratch=$(mktemp -d)
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    "${platform_args[@]}" -d "$scratch" "mlx-cuda-13==$(version_of mlx)"
  (cd "$scratch" && "$python" -m zipfile -e mlx_cuda_13-*.whl unpacked)
  strip --strip-unneeded "$scratch"/unpacked/mlx/lib/libmlx.so
  tar -C "$scratch/unpacked" -cf - . | xz -9 -T0 | split -b "$((part_mb * 1000 * 1000))" -d - "$dir/mlx-cuda.tar.xz.part-"
  rm -rf "$scratch"
  echo "$dir: $(ls "$dir/wheels" | wc -l) wheels ($(du -sh "$dir/wheels" | cut -f1)), MLX's CUDA build in" \
    "$(ls "$dir"/mlx-cuda.tar.xz.part-* | wc -l) parts of at most $part_mb MB"
}

install() {
  local dir=${1:?install DIR SITE} site=${2:?install DIR SITE}
  local python=${PYTHON:-python3}
  "$python" -m pip install --quiet --no-index --no-deps --target "$site" "$dir"/wheels/*.whl
  # After the wheels: a later install of mlx's wheel would replace the CUDA build's mlx/lib.
  cat "$dir"/mlx-cuda.tar.xz.part-* | xz -d | tar -C "$site" -xf -
  PYTHONPATH="$site" "$python" -c 'import mlx.core as mx; print("MLX", mx.__version__, "on", mx.default_device())'
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  install) shift; install "$@" ;;
  *) echo "usage: bash bench/gpu_kit.sh pack [DIR] [PART_MB] | install DIR SITE" >&2; exit 2 ;;
esac
