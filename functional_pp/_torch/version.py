"""The torch versions functional_pp supports: the ones its whole suite passes on.

``pyproject.toml`` declares the same range (tests/_torch/test_version.py checks that they
agree). Importing the package with another torch warns once, naming the version found and
what still works, instead of failing later inside a private API."""
from __future__ import annotations

import warnings

import torch

#: (major, minor) versions the suite is run on, lowest and highest included (docs/torch_versions.md:
#: which folders ran on which release, with counts and times)
SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))

#: versions tried beyond the range, with what was run there (none: 2.10 and 2.16 were not run)
KNOWN: dict[tuple[int, int], str] = {}


class UnsupportedTorchWarning(UserWarning):
    """torch is outside the range functional_pp was tested with."""


def parse(version: str) -> tuple[int, int]:
    """``"2.14.1+cu128"`` -> ``(2, 14)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def unsupported_message(version: str) -> str | None:
    """Why ``version`` is not supported and what still works, or None when it is supported."""
    low, high = SUPPORTED
    if low <= parse(version) <= high:
        return None
    span = f"{low[0]}.{low[1]}" if low == high else f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    known = KNOWN.get(parse(version))
    if known is not None:
        return (f"functional_pp is tested with torch {span}, but torch {version} is installed: {known}. "
                f"Install a supported torch: pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'")
    return (f"functional_pp is tested with torch {span}, but torch {version} is installed. Eager "
            f"training, the collectives on real processes and checkpoints use public torch APIs and "
            f"should work; torch.compile'd steps (compile/ passes, inductor hooks), the batched "
            f"simulator (functorch levels) and the planner's memory tracker rely on private torch "
            f"internals (functional_pp/_torch/) and may fail. Install a supported torch: "
            f"pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'")


def check_torch_version(version: str = torch.__version__) -> None:
    """Warn (UnsupportedTorchWarning) when ``version`` is outside :data:`SUPPORTED`."""
    message = unsupported_message(version)
    if message is not None:
        warnings.warn(message, UnsupportedTorchWarning, stacklevel=3)
