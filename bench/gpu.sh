#!/usr/bin/env bash
# The GPU figures of docs/engines.md in one run, on a machine with exo set up
# (scripts/setup.sh) and a GPU MLX sees (NVIDIA with MLX's CUDA build, or Apple silicon):
#
#   bash bench/gpu.sh [OUT_DIR] [PART]  # JSON and logs in OUT_DIR (default: gpu-bench);
#                                       # PART: batching, step, memory or all (the default)
#
# 1. Batching and splits: exo on one node, a pipeline and a tensor split over two nodes on
#    this machine, raw mlx-lm (`BatchGenerator`) and mlx_lm.server, on a random float32
#    llama (2048 x 16, about 3 GB): 1 and 8 streams of 128 and 2,048-token prompts, the
#    splits' texts checked against one node's.
# 2. Step: the 8 x 2,048-token cell again, exo on one node against raw mlx-lm, and the
#    memory cell below, with the GPU's step before 7 December (EXO_PREFILL_STEP=2048
#    EXO_PREFILL_CHUNK=2048: one prompt of 2,048 tokens a step) against its default now
#    (mlx-lm's: 8 prompts of 2,048 tokens a step), what it gives and what it costs
#    (docs/engines.md, "On a GPU").
# 3. Memory: 16 prompts of 4,096 tokens at once on a 4096 x 8 llama (about 7 GB) with the
#    prefix cache on, and exo's peak memory against the weights plus the requests' KV.
#
# Sizes can be made smaller for a smaller GPU: BATCH_MODEL="--hidden 1024 --layers 8",
# MEMORY_MODEL="--hidden 2048 --layers 8". A run takes a few minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-bench}
part=${2:-all}
case "$part" in batching|step|memory|all) ;; *) echo "PART is batching, step, memory or all, not '$part'" >&2; exit 2 ;; esac
mkdir -p "$out"
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
bench=("$python" -m exo.devtools.exo_bench --engine mlx)
export PYTHONUNBUFFERED=1

read -r -a batch_model <<<"${BATCH_MODEL:---hidden 2048 --layers 16}"
read -r -a memory_model <<<"${MEMORY_MODEL:---hidden 4096 --layers 8}"

# 16 prompts of 4,096 tokens at once, the prefix cache on; $1 names the files.
memory_cell() {
  "${bench[@]}" "${memory_model[@]}" --context 8192 --pp 4096 --tg 16 --concurrency 16 --prefix-cache on \
      --rounds 1 --json "$out/$1.json" 2>&1 | tee "$out/$1.log"
}

if [ "$part" = batching ] || [ "$part" = all ]; then
  echo "== batching and splits"
  "${bench[@]}" "${batch_model[@]}" --side-by-side --verify --pp 128,2048 --tg 128 --concurrency 1,8 \
      --placements single,pipeline,tensor --rounds 2 --json "$out/batching.json" 2>&1 | tee "$out/batching.log"
fi
if [ "$part" = step ] || [ "$part" = all ]; then
  echo "== the 8 x 2,048 cell and the memory cell with a 2,048-token step"
  export EXO_PREFILL_STEP=2048 EXO_PREFILL_CHUNK=2048
  "${bench[@]}" "${batch_model[@]}" --side-by-side --pp 2048 --tg 128 --concurrency 8 --placements single \
      --rounds 2 --json "$out/step.json" 2>&1 | tee "$out/step.log"
  memory_cell step-memory
  unset EXO_PREFILL_STEP EXO_PREFILL_CHUNK
fi
if [ "$part" = memory ] || [ "$part" = all ]; then
  echo "== memory"
  memory_cell memory
fi
