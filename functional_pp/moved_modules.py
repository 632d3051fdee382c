"""Old import paths of modules that moved into ``cli/``, ``config/`` and ``app/``
(docs/architecture.md, "The application layer"): ``import functional_pp.trainer`` still works,
warns once with a DeprecationWarning naming the new path, and yields the very module object
of the new path (so attributes set on one are seen through the other)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old module (relative to the package) -> where it lives now
MOVED: dict[str, str] = {
    "cli_errors": "cli.errors", "cli_plan": "cli.plan", "commands": "cli.commands",
    "config_aliases": "config.aliases", "config_schema": "config.schema",
    "config_sections": "config.sections",
    "trainer": "app.loop", "finetune": "app.inputs", "evaluate": "app.evaluate",
    "export": "app.export", "metrics_log": "app.metrics", "plot": "app.plot",
    "resume_check": "app.resume_check",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``<package>.<old>`` to the module now at ``<package>.<new>``."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname: str, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != self.package or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = f"{self.package}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there "
                      f"(the old path will be removed)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the module: give it back its own
        module.__spec__ = module.__spec__.loader_state


def install(package: str) -> None:
    """Make the old paths of ``package``'s moved modules importable (idempotent)."""
    if not any(isinstance(f, _MovedModuleFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder(package))   # before stale copies of old files
