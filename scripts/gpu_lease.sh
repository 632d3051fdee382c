#!/usr/bin/env bash
# One prepared run for a lent GPU machine (docs/gpu.md "On a lent GPU"): everything a short
# lease should do, in one call, each part under its own time limit.
#
#   bash scripts/gpu_lease.sh prepare    # here, with network: wheels the GPU image lacks -> .whl/
#   bash scripts/gpu_lease.sh run        # there (device tool, carry [".whl"]): results -> $OUT
#
# The GPU image has torch (2.11.0+cu130 so far), transformers and triton but not optree and no
# network, so `prepare` downloads optree's wheels for the Pythons such images ship.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  prepare)
    for py in 3.10 3.11 3.12 3.13; do
      pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl optree typing_extensions
    done
    ls .whl ;;
  run)
    OUT=${OUT:-$(mktemp -d)}
    python -c "import optree" 2>/dev/null || pip install --quiet --no-index --find-links .whl optree
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    python -c "import torch, functional_pp; print(torch.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
    # the issue's table: both rows, interleaved timing, profiler summaries (under 8 minutes on an H200)
    timeout "${FPP_GPU_BENCH_TIMEOUT:-420}" python benchmarks/gpu.py --json "$OUT/gpu.json" 2>&1 | tail -40 \
      || echo "gpu.py stopped (timeout or failure); $OUT/gpu.json holds the rows it finished"
    # the memory levers on the 1B row, predicted and measured (FPP_GPU_LEVERS_TIMEOUT=0 skips them)
    if [ "${FPP_GPU_LEVERS_TIMEOUT:-150}" != 0 ]; then
      timeout "${FPP_GPU_LEVERS_TIMEOUT:-150}" python benchmarks/memory_levers.py --measure --json "$OUT/levers.json" \
        2>&1 | tail -12 || echo "memory_levers.py stopped (timeout or failure)"
    fi ;;
  *)
    echo "usage: bash scripts/gpu_lease.sh prepare|run" >&2; exit 2 ;;
esac
