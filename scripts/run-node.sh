#!/usr/bin/env bash
# Sets exo up (runtime dependencies only) and starts a node that serves the built-in demo
# model on port 52415. Extra arguments go to `exo` (see `exo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh runtime
exec .venv/bin/exo --place-model exo/demo-chat "$@"
