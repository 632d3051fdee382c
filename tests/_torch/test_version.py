"""The supported torch range: declared once in _torch/version.py, equal to pyproject.toml's,
checked at import with a message that names the version and what still works."""
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

from functional_pp._torch import version as V

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("found", ["2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.13.0a0+git1234",
                                   "2.14.1+cu130", "2.15.0+cu132"])
def test_supported_versions_pass(found):
    assert V.unsupported_message(found) is None


def test_a_version_tried_beyond_the_range_says_what_was_run_there(monkeypatch):
    monkeypatch.setitem(V.KNOWN, (2, 16), "on torch 2.16.0 only the eager tests were run")
    message = V.unsupported_message("2.16.0+cu132")
    assert "torch 2.16.0+cu132 is installed: on torch 2.16.0 only the eager tests were run" in message
    assert "pip install 'torch>=2.11,<2.16'" in message


@pytest.mark.parametrize("found", ["2.10.0", "2.10.0+cu128", "2.16.0", "2.16.0+cu132", "3.0.0+cpu"])
def test_unsupported_versions_are_named_with_what_still_works(found):
    message = V.unsupported_message(found)
    assert f"torch {found} is installed" in message and "tested with torch 2.11 to 2.15" in message
    assert "pip install 'torch>=2.11,<2.16'" in message
    assert "Eager training" in message and "torch.compile" in message and "pip install" in message
    with pytest.warns(V.UnsupportedTorchWarning, match=re.escape(found)):
        V.check_torch_version(found)


def test_the_installed_torch_is_supported_and_imports_without_a_warning():
    assert V.unsupported_message(torch.__version__) is None
    out = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import functional_pp"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_pyproject_declares_the_same_range():
    deps = re.search(r"dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S).group(1)
    spec = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', deps)
    assert spec, f"pyproject.toml must pin torch as >=low,<high+1: {deps}"
    lo, hi = (int(spec[1]), int(spec[2])), (int(spec[3]), int(spec[4]) - 1)
    assert (lo, hi) == V.SUPPORTED


@pytest.mark.parametrize("found", ["2.10.0+cu128", "2.16.0"])
def test_importing_with_an_unsupported_torch_warns_once(found):
    """The package imported (and used) with torch reporting ``found``: exactly one
    UnsupportedTorchWarning, naming that version, what works and what to install."""
    code = (f"import torch, warnings\ntorch.__version__ = {found!r}\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import functional_pp, functional_pp._torch.version, functional_pp.compile\n"
            "mine = [str(w.message) for w in seen if w.category.__name__ == 'UnsupportedTorchWarning']\n"
            "print(len(mine)); print(mine[0] if mine else '')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, message = out.stdout.strip().split("\n", 1)
    assert count == "1", out.stdout
    assert f"torch {found} is installed" in message and "Eager training" in message
    assert "pip install 'torch>=2.11,<2.16'" in message


def test_ci_smokes_the_lowest_and_the_highest_supported_release():
    """.ci/run's smoke test runs on a release of SUPPORTED's lowest and highest minor version."""
    run = (ROOT / ".ci" / "run").read_text()
    versions = re.search(r"SMOKE_TORCH=\$\{FPP_SMOKE_TORCH-([0-9. ]+)\}", run).group(1).split()
    assert [V.parse(v) for v in versions] == list(V.SUPPORTED)
    assert (ROOT / "scripts" / "torch_smoke.sh").is_file()
