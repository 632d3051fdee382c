#!/usr/bin/env bash
# Install functional_pp with its test dependencies. torch is pinned to 2.13.0 first: on this
# project's CPU machines that resolves to the local CPU wheel (an open range would pull the
# multi-GB CUDA build). Elsewhere, for a CPU-only install, add
# `--index-url https://download.pytorch.org/whl/cpu` to the first command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[test,plot]"
