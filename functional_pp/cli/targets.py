"""Files a command will write, checked before its work (docs/bad_inputs.md §7): a minutes-long
search or run must not end in a traceback because the folder of its output file is missing."""
from __future__ import annotations

import os
from pathlib import Path

from functional_pp.config import ConfigError

__all__ = ["check_file_target"]


def check_file_target(path: str, flag: str) -> Path:
    """``path`` as a file this command can write, else :class:`ConfigError` naming ``flag``, the
    path and what to fix (a missing or unwritable folder, a directory in the file's place)."""
    target = Path(os.path.expanduser(path))
    folder = target.parent
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name, e.g. {flag} {target / 'plan.json'}")
    if not folder.exists():
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) "
                          f"or write the file elsewhere")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path}: cannot write there (permissions); choose a writable folder")
    return target
