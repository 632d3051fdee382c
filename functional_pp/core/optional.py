"""Optional dependencies: every import of a package outside ``pip install functional_pp``'s
own dependencies goes through :func:`require`, so a lean install trains, and using a feature
that needs more names the feature and the extra that brings it."""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require", "available", "OptionalDependencyError"]


class OptionalDependencyError(ImportError):
    """A feature was used whose package is not installed (an ``ImportError``)."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` (dotted names allowed) for ``feature``; if it is missing, raise
    :class:`OptionalDependencyError` naming the feature and ``pip install 'functional_pp[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise OptionalDependencyError(
            f"{feature} needs the '{top}' package, which is not installed: "
            f"pip install 'functional_pp[{extra}]' (or pip install {top})") from exc


def available(module: str) -> bool:
    """Whether ``module`` imports (for features that are skipped, not refused, without it)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
