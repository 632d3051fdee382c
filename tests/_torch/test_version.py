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


@pytest.mark.parametrize("found", ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.13.0a0+git1234", "2.14.1+cu130"])
def test_supported_versions_pass(found):
    assert V.unsupported_message(found) is None


def test_a_version_tried_beyond_the_range_says_what_was_run_there(monkeypatch):
    monkeypatch.setitem(V.KNOWN, (2, 15), "on torch 2.15.0 only the eager tests were run")
    message = V.unsupported_message("2.15.0+cu130")
    assert "torch 2.15.0+cu130 is installed: on torch 2.15.0 only the eager tests were run" in message
    assert "pip install 'torch>=2.13,<2.15'" in message


@pytest.mark.parametrize("found", ["2.12.1", "2.15.0", "3.0.0+cpu"])
def test_unsupported_versions_are_named_with_what_still_works(found):
    message = V.unsupported_message(found)
    assert f"torch {found} is installed" in message and "tested with torch 2.13 to 2.14" in message
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
