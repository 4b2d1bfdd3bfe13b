#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs exo. Safe to re-run.
#   bash scripts/setup.sh          what a node needs to run (run-node.sh)
#   bash scripts/setup.sh test     that plus the test extras: pytest, the SDKs, schemathesis,
#                                  torch, basedpyright (test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-runtime}" in
  runtime) mode=runtime target="." ;;
  test) mode=test target=".[test]" ;;
  *) echo "usage: scripts/setup.sh [runtime|test]" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "exo needs Python 3.11 or newer (found $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The llama.cpp engine on Linux, built from source once (about 10 minutes on 2 cores) with
# ggml's RPC backend (splits across nodes) and kept as a wheel in a cache named by the
# build flags, so a fresh clone on the same machine installs it in seconds. On x86 the
# build is native minus AMX: ggml's AMX matmul segfaults on a Sapphire Rapids VM whose
# AMX itself works (llama.cpp issue 20824; docs/engines.md).
LLAMA_CPP_VERSION=0.3.36
install_llama_cpp() {
  local flags="-DGGML_RPC=ON"
  if [ "$(uname -m)" = x86_64 ]; then
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    flags="$flags -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
  fi
  local key
  key=$(printf '%s %s %s' "$LLAMA_CPP_VERSION" "$flags" "$(.venv/bin/python -c 'import sys; print(sys.version_info[:2])')" | sha256sum | cut -c1-16)
  local wheels="${XDG_CACHE_HOME:-$HOME/.cache}/exo/wheels/llama-cpp-$key"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_CPP_VERSION (once, about 10 minutes)..." >&2
    mkdir -p "$wheels"
    CMAKE_ARGS="$flags" .venv/bin/python -m pip wheel --quiet --no-deps --no-cache-dir \
      -w "$wheels" "llama-cpp-python==$LLAMA_CPP_VERSION"
  fi
  .venv/bin/python -m pip install --quiet --find-links "$wheels" "llama-cpp-python==$LLAMA_CPP_VERSION"
}
# One stamp per mode, so a runtime-only venv still gets the test extras when the tests
# first run; a test install covers the runtime one too. pip runs again when
# pyproject.toml is newer than the stamp.
stamp=".venv/.exo-installed-$mode"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  if [ "$(uname -s)" = Linux ]; then
    install_llama_cpp
  fi
  .venv/bin/python -m pip install --quiet -e "$target"
  touch "$stamp"
  if [ "$mode" = test ]; then
    touch .venv/.exo-installed-runtime
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
