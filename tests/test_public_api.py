"""The top level is a small, documented API: every public name is in ``__all__`` or is one of
the package's folders (a submodule), and every name of ``__all__`` exists and has a docstring."""
import inspect
import pathlib
import types

import functional_pp as fpp

FOLDERS = {p.name for p in pathlib.Path(fpp.__file__).parent.iterdir() if (p / "__init__.py").is_file()}


def test_every_public_attribute_is_exported_or_a_folder():
    stray = sorted(n for n in dir(fpp) if not n.startswith("_") and n not in fpp.__all__
                   and not (isinstance(getattr(fpp, n), types.ModuleType) and n in FOLDERS | {"version"}))
    assert not stray, f"public names of functional_pp that are not in __all__: {stray}"


def test_the_exported_names_exist_and_say_what_they_are():
    assert len(fpp.__all__) == len(set(fpp.__all__)) <= 48, "keep the top level small: put it in a submodule"
    undocumented = [n for n in fpp.__all__ if not inspect.getdoc(getattr(fpp, n))]
    assert not undocumented, f"exported without a docstring: {undocumented}"


def test_no_exported_function_shadows_a_module_of_the_same_path():
    for name in fpp.__all__:
        obj = getattr(fpp, name)
        if not isinstance(obj, types.ModuleType):
            assert name not in FOLDERS, f"functional_pp.{name} is both a folder and a {type(obj).__name__}"
