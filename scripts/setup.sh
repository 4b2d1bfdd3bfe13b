#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs exo. Safe to re-run.
#   bash scripts/setup.sh          what a node needs to run (run-node.sh)
#   bash scripts/setup.sh test     that plus the test extras: pytest, the SDKs, schemathesis,
#                                  torch, basedpyright (test.sh)
# What each machine gets is scripts/mlx_build.py's choice: Apple silicon, MLX on Metal;
# Linux with an NVIDIA driver for CUDA 12.4 or newer, MLX's CUDA 12 or 13 build and no
# llama.cpp; other Linux, MLX's CPU build and llama.cpp, built once.
#   EXO_WHEELHOUSE=DIR   install offline, only from the wheels in DIR (pip --no-index)
#   EXO_SETUP_DRY_RUN=1  print what would be installed and change nothing
set -euo pipefail
wheelhouse=""
if [ -n "${EXO_WHEELHOUSE:-}" ]; then
  # Absolute, since the script moves to the repository root next.
  wheelhouse=$(cd "$EXO_WHEELHOUSE" && pwd)
fi
cd "$(dirname "$0")/.."
case "${1:-runtime}" in
  runtime) mode=runtime ;;
  test) mode=test ;;
  *) echo "usage: scripts/setup.sh [runtime|test]" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "exo needs Python 3.11 or newer (found $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
dry_run="${EXO_SETUP_DRY_RUN:-}"
# Runs a command that changes the machine; a dry run prints it instead, with the words
# that hold more than a plain word (requirements with markers) in double quotes.
run() {
  if [ -n "$dry_run" ]; then
    local word line="+"
    for word in "$@"; do
      case "$word" in
        *[!A-Za-z0-9_./=:@+-]*) line="$line \"$word\"" ;;
        *) line="$line $word" ;;
      esac
    done
    echo "$line"
  else
    "$@"
  fi
}
pip_source=()
if [ -n "$wheelhouse" ]; then
  pip_source=(--no-index --find-links "$wheelhouse")
fi
# (The odd expansion keeps an empty array legal under `set -u` in macOS's bash 3.2.)
pip_install() {
  run .venv/bin/python -m pip install --quiet ${pip_source[@]+"${pip_source[@]}"} "$@"
}
if [ ! -x .venv/bin/python ]; then
  run "$PYTHON" -m venv .venv
fi
# The llama.cpp engine on Linux without MLX's CUDA build, built from source once (about 10
# minutes on 2 cores) with ggml's RPC backend (splits across nodes) and kept as a wheel in a
# cache named by the build flags, so a fresh clone on the same machine installs it in
# seconds; a wheelhouse's llama.cpp wheel (such a cached one) is taken as it is. On x86 the
# build is native minus AMX: ggml's AMX matmul segfaults on a Sapphire Rapids VM whose
# AMX itself works (llama.cpp issue 20824; docs/engines.md).
LLAMA_CPP_VERSION=0.3.36
install_llama_cpp() {
  local requirement="llama-cpp-python==$LLAMA_CPP_VERSION"
  if [ -n "$wheelhouse" ] && ls "$wheelhouse"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl >/dev/null 2>&1; then
    pip_install "$requirement"
    return
  fi
  local flags="-DGGML_RPC=ON"
  if [ "$(uname -m)" = x86_64 ]; then
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    flags="$flags -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
  fi
  local python=.venv/bin/python
  if [ ! -x "$python" ]; then
    python=$PYTHON  # a dry run before the venv exists; the venv will be made from it
  fi
  local key
  key=$(printf '%s %s %s' "$LLAMA_CPP_VERSION" "$flags" "$("$python" -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
  local wheels="${XDG_CACHE_HOME:-$HOME/.cache}/exo/wheels/llama-cpp-$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION (once, about 10 minutes)..." >&2
    run mkdir -p "$wheels"
    run env CMAKE_ARGS="$flags" .venv/bin/python -m pip wheel --quiet --no-deps --no-cache-dir \
      ${pip_source[@]+"${pip_source[@]}"} -w "$wheels" "$requirement"
  fi
  pip_install --find-links "$wheels" "$requirement"
}
# MLX's backend packages all write mlx/lib/libmlx.so, so one left by an earlier setup (before
# a driver came or changed) would overwrite the chosen one's library, or delete it when it
# went later. Any other found goes, the chosen one with it, to be installed again after.
remove_other_mlx_backends() {
  local keep=$1 installed=() package
  for package in mlx-cpu mlx-cuda-12 mlx-cuda-13; do
    if [ -x .venv/bin/python ] && .venv/bin/python -m pip show --quiet "$package" >/dev/null 2>&1; then
      installed+=("$package")
    fi
  done
  for package in ${installed[@]+"${installed[@]}"}; do
    if [ "$package" != "$keep" ]; then
      run .venv/bin/python -m pip uninstall --quiet --yes "${installed[@]}"
      return
    fi
  done
}
# The MLX build for this machine (a requirement such as mlx[cuda13]), a tab, and why.
choice=$("$PYTHON" scripts/mlx_build.py)
mlx=${choice%%$'\t'*}
why=${choice#*$'\t'}
case "$mlx" in
  'mlx[cpu]') mlx_backend=mlx-cpu ;;
  'mlx[cuda12]') mlx_backend=mlx-cuda-12 ;;
  'mlx[cuda13]') mlx_backend=mlx-cuda-13 ;;
  *) mlx_backend="" ;;  # macOS: one package, Metal
esac
# One stamp per mode, holding the MLX build installed, so a runtime-only venv still gets the
# test extras when the tests first run, and a new or changed driver gets its build; a test
# install covers the runtime one too. pip runs again when pyproject.toml is newer than the stamp.
stamp=".venv/.exo-installed-$mode"
if [ -n "$dry_run" ] || [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$mlx" ]; then
  echo "exo setup: $why" >&2
  requirements=$("$PYTHON" scripts/mlx_build.py requirements "$mlx" "$mode")
  exo_requirements=()
  while IFS= read -r requirement; do
    exo_requirements+=("$requirement")
  done <<<"$requirements"
  pip_install --upgrade pip
  if [ -n "$mlx_backend" ]; then
    remove_other_mlx_backends "$mlx_backend"
  fi
  # llama.cpp where MLX has only the CPU: with a CUDA build `--engine auto` picks MLX.
  if [ "$mlx_backend" = mlx-cpu ]; then
    install_llama_cpp
  fi
  pip_install "${exo_requirements[@]}"
  # exo itself without its declared dependencies: those are the list above, which swaps
  # in the MLX build chosen here and leaves llama-cpp-python out where MLX has CUDA.
  pip_install --no-deps -e .
  if [ -z "$dry_run" ]; then
    echo "$mlx" >"$stamp"
    if [ "$mode" = test ]; then
      echo "$mlx" >.venv/.exo-installed-runtime
    fi
  fi
fi
if [ -n "$dry_run" ]; then
  exit 0
fi
if [ "$(uname -s)" = Linux ] && ! ldconfig -p 2>/dev/null | grep -q 'libgfortran\.so\.5'; then
  # The OpenBLAS wheel MLX's Linux build is given (engine/mlx/blas.py) links libgfortran;
  # without it MLX keeps its reference BLAS, ~10x slower at a matmul.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update && apt-get install -y libgfortran5
  else
    echo "MLX keeps its slow reference BLAS without libgfortran5 (apt-get install libgfortran5)" >&2
  fi
fi
if [ "$mode" = test ] && [ ! -x /usr/bin/chromium ]; then
  # The dashboard's browser tests drive Debian's chromium (never a downloaded browser).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update && apt-get install -y chromium
  else
    echo "the dashboard's browser tests need /usr/bin/chromium: apt-get install chromium (as root)" >&2
  fi
fi
if [ "$mode" = test ]; then
  # The dashboard's browser tests run the real opencode client (npm's opencode-ai, pinned in
  # tests/support/opencode.py) on the config the page copies; installed once into
  # ~/.cache/exo/npm. Needs node and npm.
  if command -v npm >/dev/null; then
    .venv/bin/python -m tests.support.opencode >/dev/null ||
      echo "could not install opencode from npm: the dashboard's opencode test will try again" >&2
  else
    echo "the dashboard's browser tests need node and npm (apt-get install nodejs npm) for opencode" >&2
  fi
fi
