#!/usr/bin/env bash
# Install functional_pp with its test dependencies.
#
#   bash scripts/setup.sh                                   # CPU or whatever torch is already here
#   FPP_EXTRAS= bash scripts/setup.sh                       # lean: only what training needs
#   FPP_EXTRAS=plot,hf bash scripts/setup.sh                # chosen extras (default: test,plot,hf)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh   # a CUDA build
#   TORCH_VERSION=2.13.0 bash scripts/setup.sh              # pin another torch version
#   PYTHON=/path/to/python bash scripts/setup.sh            # a specific interpreter
#
# - torch: an installed torch in pyproject.toml's supported range (torch>=2.11,<2.16) is kept,
#   whatever its build (a GPU image's CUDA build is never replaced by a CPU wheel), unless
#   TORCH_VERSION is set and newer; otherwise torch==TORCH_VERSION (default 2.13.0) is installed
#   (from TORCH_INDEX_URL if set). The package and its extras are then installed with torch
#   pinned to the installed one (a pip constraint: no dependency upgrades or downgrades it).
# - works with only `python3` on the PATH.
# - if the interpreter is "externally managed" (PEP 668: Debian/Ubuntu system Python), a venv is
#   created (or reused) in .venv and everything goes there; activate it with
#   `source .venv/bin/activate`. Set FPP_VENV=1 to always use a venv, FPP_VENV_DIR to place it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if command -v python >/dev/null 2>&1; then PY=python
  elif command -v python3 >/dev/null 2>&1; then PY=python3
  else echo "setup.sh: no python or python3 on the PATH" >&2; exit 1; fi
fi
AT_LEAST=${TORCH_VERSION:-}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${FPP_EXTRAS-test,plot,hf}      # set and empty: no extras (a lean install)

managed=$("$PY" -c 'import os, sysconfig; print(int(os.path.exists(os.path.join(sysconfig.get_paths()["stdlib"], "EXTERNALLY-MANAGED"))))')
in_venv=$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
VENV=${FPP_VENV_DIR:-.venv}
if { [ "$managed" = 1 ] && [ "$in_venv" = 0 ]; } || [ "${FPP_VENV:-0}" = 1 ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    if [ "${FPP_VENV:-0}" = 1 ]; then why="FPP_VENV=1"; else why="$PY is externally managed: PEP 668"; fi
    echo "setup.sh: creating a virtual environment in $VENV ($why)"
    "$PY" -m venv "$VENV"
  fi
  PY=$VENV/bin/python
  echo "setup.sh: installing into $VENV (activate with: source $VENV/bin/activate)"
fi

have=$("$PY" - "$AT_LEAST" <<'PYEOF'
import re, sys
try:
    import torch
except ImportError:
    print("none"); sys.exit()
def key(v):
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return out
low, below = (key(b) for b in re.search(r'"torch>=([0-9.]+),<([0-9.]+)"', open("pyproject.toml").read()).groups())
v = key(torch.__version__)
at_least = sys.argv[1]
in_range = low[:2] <= v[:2] < below[:2]
if in_range and (not at_least or key(at_least) <= v):
    print("ok")
else:
    print(("older:" if in_range else "unsupported:") + torch.__version__)
PYEOF
)
if [ "$have" = ok ]; then
  echo "setup.sh: keeping the installed torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
else
  echo "setup.sh: installing torch==$TORCH_VERSION${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL} (found: $have)"
  "$PY" -m pip install -q "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# the package with torch pinned to the one now installed: no dependency may replace it
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
"$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$pin"
PIP_CONSTRAINT="$pin${PIP_CONSTRAINT:+ $PIP_CONSTRAINT}" "$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
echo "setup.sh: installed functional_pp${EXTRAS:+ with the extras $EXTRAS}${EXTRAS:- (lean: add extras with pip install -e '.[test,plot,hf]')}"
