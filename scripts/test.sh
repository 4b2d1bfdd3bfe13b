#!/usr/bin/env bash
# Sets exo up with its test extras, type-checks src/ (pyrightconfig.json) and runs the whole
# test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/basedpyright
exec .venv/bin/python -m pytest -q "$@"
