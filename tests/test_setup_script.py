"""scripts/setup.sh's decisions, with a stand-in interpreter that records pip and venv calls
(nothing is installed): keep a torch that satisfies the requirement (any supported one, a
CUDA build included, pinned while the package installs), honour TORCH_VERSION /
TORCH_INDEX_URL, create and use a venv when asked (as for an externally managed Python)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$0 PIP ${*:3}${PIP_CONSTRAINT:+ [constraint: $(cat ${PIP_CONSTRAINT%% *})]}" >> "$LOG"; exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; echo "VENV $3" >> "$LOG"; exit 0; fi
exec python3 "$@"
"""


def run(tmp_path, torch_version=None, **env):
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    full = {**os.environ, "PYTHON": str(fake), "LOG": str(log), **env}
    full.pop("PIP_CONSTRAINT", None)
    if torch_version is not None:           # a stand-in torch module reporting that version
        (tmp_path / "torch").mkdir(exist_ok=True)
        (tmp_path / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
        full["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=full, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout, log.read_text().splitlines()


def test_keeps_a_torch_that_satisfies_the_requirement(tmp_path):
    out, calls = run(tmp_path, TORCH_VERSION="2.0")
    assert "keeping the installed torch" in out
    assert len(calls) == 1 and "-e .[test,plot,hf]" in calls[0]


def test_installs_the_requested_torch_from_the_index(tmp_path):
    out, calls = run(tmp_path, TORCH_VERSION="99.1", TORCH_INDEX_URL="https://example.invalid/whl/cu128")
    assert "installing torch==99.1" in out
    assert calls[0].endswith("PIP install -q torch==99.1 --index-url https://example.invalid/whl/cu128")


def test_creates_and_uses_a_venv(tmp_path):
    venv = tmp_path / "venv"
    out, calls = run(tmp_path, FPP_VENV="1", FPP_VENV_DIR=str(venv), TORCH_VERSION="2.0")
    assert calls[0] == f"VENV {venv}" and "activate with: source" in out
    assert "(FPP_VENV=1)" in out and "PEP 668" not in out            # the reason it gives is the real one
    assert calls[1].startswith(f"{venv}/bin/python PIP install -q -e")
    out, calls = run(tmp_path, FPP_VENV="1", FPP_VENV_DIR=str(venv), TORCH_VERSION="2.0")
    assert not any(c.startswith("VENV") for c in calls)               # reused


@pytest.mark.parametrize("found", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.15.0+cu132"])
def test_keeps_any_supported_torch_and_pins_it_while_installing(tmp_path, found):
    """A GPU image's torch 2.11.0+cu130 stays (no CPU wheel replaces it), and no extra may
    upgrade or downgrade it (a pip constraint file pinning it, which also replaces a machine's
    pip cap for that install)."""
    out, calls = run(tmp_path, torch_version=found)
    assert f"keeping the installed torch ({found})" in out
    assert len(calls) == 1 and "-e .[test,plot,hf]" in calls[0] and f"[constraint: torch=={found}]" in calls[0]


@pytest.mark.parametrize("found", ["2.10.0+cu128", "2.16.0", "1.13.1"])
def test_replaces_an_unsupported_torch_with_the_default(tmp_path, found):
    out, calls = run(tmp_path, torch_version=found)
    assert f"installing torch==2.13.0 (found: unsupported:{found})" in out
    assert calls[0].endswith("PIP install -q torch==2.13.0")


def test_torch_version_asks_for_at_least_that_version(tmp_path):
    out, calls = run(tmp_path, torch_version="2.11.0+cu130", TORCH_VERSION="2.12.1")
    assert "installing torch==2.12.1 (found: older:2.11.0+cu130)" in out


@pytest.mark.parametrize("extras, target", [("", "-e ."), ("plot,hf", "-e .[plot,hf]")])
def test_fpp_extras_chooses_the_extras_empty_is_a_lean_install(tmp_path, extras, target):
    out, calls = run(tmp_path, torch_version="2.13.0", FPP_EXTRAS=extras)
    assert len(calls) == 1 and calls[0].split(" [constraint")[0].endswith(f"PIP install -q {target}")
    assert ("lean" in out) == (extras == "")
