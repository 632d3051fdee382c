"""Old import paths of the application modules keep working, with a DeprecationWarning, and
give the very module of the new path (docs/architecture.md, "The application layer")."""
import importlib
import subprocess
import sys

import pytest

import functional_pp
from functional_pp.moved_modules import MOVED


def test_each_old_path_warns_in_a_fresh_interpreter():
    """With DeprecationWarning as an error, importing each old path raises it (naming the new path)."""
    code = ("import warnings, importlib\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "import functional_pp\n"
            "from functional_pp.moved_modules import MOVED\n"
            "for old in MOVED:\n"
            "    try:\n"
            "        importlib.import_module('functional_pp.' + old)\n"
            "    except DeprecationWarning as w:\n"
            "        print('WARNED', w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for old, new in MOVED.items():
        assert f"WARNED functional_pp.{old} moved to functional_pp.{new}" in out.stdout


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_path_is_the_new_module(old, new):
    with pytest.warns(DeprecationWarning, match=f"functional_pp.{new}"):
        sys.modules.pop(f"functional_pp.{old}", None)
        module = importlib.import_module(f"functional_pp.{old}")
    real = importlib.import_module(f"functional_pp.{new}")
    assert module is real
    assert real.__spec__.name == f"functional_pp.{new}"     # the alias did not re-stamp it


def test_from_import_of_an_old_name_and_unknown_names():
    with pytest.warns(DeprecationWarning, match="functional_pp.app.loop"):
        sys.modules.pop("functional_pp.trainer", None)
        from functional_pp.trainer import train
    from functional_pp.app.loop import train as real
    assert train is real
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("functional_pp.no_such_module")


def test_every_moved_module_exists_and_the_old_file_is_gone():
    root = functional_pp.__path__[0]
    import os
    for old, new in MOVED.items():
        assert not os.path.exists(os.path.join(root, old + ".py")), f"{old}.py is back at the root"
        importlib.import_module(f"functional_pp.{new}")
