#!/usr/bin/env bash
# A short compile-and-train smoke test of functional_pp on one torch release, in a virtual
# environment of its own (CI runs it on the lowest and the highest supported release while the
# whole suite runs on the default one; docs/torch_versions.md).
#
#   bash scripts/torch_smoke.sh 2.11.0                 # install (or reuse) the venv, then test
#   bash scripts/torch_smoke.sh 2.15.0 install         # only make the venv (CI: in the background)
#   bash scripts/torch_smoke.sh 2.15.0 test            # only test, in a venv made before
#
# - the venv lives in $FPP_SMOKE_DIR/torch-<version> (default ~/.cache/functional_pp/smoke) and
#   is reused when its torch is already that release;
# - torch comes from the package index pip is configured with (PyPI's Linux wheels are CUDA
#   builds, several GB with their CUDA libraries; they run on the CPU); a pip constraint file
#   pins torch to the release, which also lifts a machine-wide cap for this venv only;
# - the package is installed with --no-deps, plus only what the selection imports;
# - when the install fails or takes longer than FPP_SMOKE_INSTALL_TIMEOUT seconds (default 1200:
#   no network, a slow mirror), the smoke is SKIPPED with a message and exit status 0; a failing
#   test exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: torch_smoke.sh VERSION [install|test|all]}
WHAT=${2:-all}
DIR=${FPP_SMOKE_DIR:-$HOME/.cache/functional_pp/smoke}/torch-$VERSION
PY=${PYTHON:-$(command -v python3 || command -v python)}
INSTALL_TIMEOUT=${FPP_SMOKE_INSTALL_TIMEOUT:-1200}
SKIPPED="$DIR.skipped"
# the selection: the compiled step's differentiable leaves on both paths, the CUDA guard pinned
# across device threads, the version check, and whole-step / per-layer compiled training on
# simulated devices (two launches in one process) equal to eager, and the compiled selective
# checkpointing policies' graph pass (what they keep, bitwise the same step)
TESTS=(tests/_torch/test_grad_leaves.py tests/_torch/test_cuda_guard.py tests/_torch/test_version.py
       "tests/compile/test_compile_families.py::test_compiled_training_equals_eager"
       "tests/compile/test_selective_remat.py::test_compiled_selective_remat_is_exact_and_keeps_between_none_and_full")

installed() {
  [ -x "$DIR/bin/python" ] && "$DIR/bin/python" - "$VERSION" <<'PYEOF' 2>/dev/null
import sys, torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PYEOF
}

install() {
  rm -f "$SKIPPED"
  if installed; then echo "torch_smoke: reusing $DIR"; return 0; fi
  local t0=$SECONDS pin
  rm -rf "$DIR" && mkdir -p "$(dirname "$DIR")" && "$PY" -m venv "$DIR" || { echo "venv failed" > "$SKIPPED"; return 0; }
  pin="$DIR/torch-pin.txt"
  echo "torch==$VERSION" > "$pin"
  echo "torch_smoke: installing torch==$VERSION into $DIR (at most ${INSTALL_TIMEOUT}s)"
  if ! PIP_CONSTRAINT="$pin" timeout "$INSTALL_TIMEOUT" "$DIR/bin/python" -m pip install -q \
        "torch==$VERSION" "optree>=0.13" "numpy>=1.26" "safetensors>=0.4" "pyyaml>=6" \
        "pytest>=8" "pytest-timeout>=2.3" "setuptools>=61" "wheel" 2>&1 | grep -v "WARNING: Location"; then
    :
  fi
  if ! installed; then
    echo "torch==$VERSION could not be installed within ${INSTALL_TIMEOUT}s" > "$SKIPPED"
    echo "torch_smoke: $(cat "$SKIPPED")"
    return 0
  fi
  PIP_CONSTRAINT="$pin" "$DIR/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 \
    | grep -v "WARNING: Location"
  echo "torch_smoke: torch $VERSION installed in $((SECONDS - t0))s"
}

run_tests() {
  if [ -f "$SKIPPED" ] || ! installed; then
    echo "torch_smoke: SKIPPED on torch $VERSION: $(cat "$SKIPPED" 2>/dev/null || echo "no venv in $DIR")"
    return 0
  fi
  local t0=$SECONDS rc
  echo "torch_smoke: testing on torch $("$DIR/bin/python" -c 'import torch; print(torch.__version__)')"
  # an inductor cache of its own: processes of two torch releases never share compiled files
  TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/torchinductor-smoke-$VERSION" \
    "$DIR/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
  rc=$?
  echo "torch_smoke: torch $VERSION: pytest exit $rc in $((SECONDS - t0))s"
  return $rc
}

case "$WHAT" in
  install) install ;;
  test) run_tests ;;
  all) install; run_tests ;;
  *) echo "torch_smoke.sh: unknown step $WHAT (install, test or all)" >&2; exit 2 ;;
esac
