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
# One stamp per mode, so a runtime-only venv still gets the test extras when the tests
# first run; a test install covers the runtime one too. pip runs again when
# pyproject.toml is newer than the stamp.
stamp=".venv/.exo-installed-$mode"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  if [ "$(uname -s)" = Linux ]; then
    # The llama.cpp engine, built from source with ggml's RPC backend (splits across
    # nodes): about 10 minutes once, then pip reuses the wheel it cached.
    CMAKE_ARGS="-DGGML_RPC=ON" .venv/bin/python -m pip install --quiet "llama-cpp-python>=0.3.36"
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
