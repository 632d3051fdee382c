"""README.md's "Layout of the code" lists every module of the package, and names no module that
is gone.

A module ``a/b.py`` is listed when the section names it in backticks (`` `a/b.py` ``), or when
a table row whose first cell names its package (`` `a/` ``) names it by stem (`` `b` ``); a
package's ``__init__.py`` is covered by the row of `` `__init__.py` ``."""
from __future__ import annotations

import pathlib
import re

PACKAGE = "functional_pp"
REPO = pathlib.Path(__file__).resolve().parents[1]
TITLE = "## Layout of the code"


def layout_section(readme: str) -> str:
    """The text of the README's layout section (up to the next ``## `` heading)."""
    start = readme.index(TITLE)
    end = readme.find("\n## ", start + len(TITLE))
    return readme[start:] if end < 0 else readme[start:end]


def modules(root: pathlib.Path) -> list[str]:
    """Every ``.py`` file under ``root``, relative to it (``app/loop.py``)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _rows(section: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.lstrip().startswith("|")]


def _ticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def unlisted(section: str, files: list[str]) -> list[str]:
    """The files of ``files`` that ``section`` does not list."""
    named = _ticked(section)
    by_package: dict[str, set[str]] = {}
    for row in _rows(section):
        for pkg in (t for t in _ticked(row[0]) if t.endswith("/")):
            by_package.setdefault(pkg, set()).update(_ticked(" | ".join(row)))
    missing = []
    for rel in files:
        pkg, _, name = rel.rpartition("/")
        stem = name[:-3]
        if rel in named or (name == "__init__.py" and "__init__.py" in named):
            continue
        if pkg and stem in by_package.get(pkg + "/", set()):
            continue
        missing.append(rel)
    return missing


def stale(section: str, files: list[str]) -> list[str]:
    """``.py`` paths the section's table names that are not modules of the package."""
    named = _ticked("\n".join(" | ".join(row) for row in _rows(section)))
    return sorted(t for t in named if t.endswith(".py") and t != "__init__.py" and t not in files)


# ---------------------------------------------------------------------------------- tests
def test_readme_layout_lists_every_module():
    section = layout_section((REPO / "README.md").read_text())
    missing = unlisted(section, modules(REPO / PACKAGE))
    assert not missing, (f"README.md '{TITLE[3:]}' does not list these modules of {PACKAGE}/: {missing}; "
                         f"add each (as `pkg/name.py`, or by `name` in its package's row) with its job")


def test_readme_layout_names_no_missing_module():
    section = layout_section((REPO / "README.md").read_text())
    gone = stale(section, modules(REPO / PACKAGE))
    assert not gone, f"README.md '{TITLE[3:]}' names modules that do not exist: {gone}"


def test_checker_sees_a_missing_module_and_a_stale_name():
    section = ("## Layout of the code\n\n| module | job |\n|---|---|\n| `core/mesh.py` | mesh |\n"
               "| `ops/` | `einsum`, `attention` |\n| `__init__.py` (each package) | exports |\n"
               "| `old.py` | gone |\n\nChecked by `tests/test_readme_layout.py`.\n")
    files = ["core/mesh.py", "ops/einsum.py", "ops/attention.py", "ops/__init__.py", "ops/rotary.py",
             "app/loop.py", "__init__.py"]
    assert unlisted(section, files) == ["ops/rotary.py", "app/loop.py"]
    assert stale(section, files) == ["old.py"]
    readme = "# x\n" + section + "\n## Next\n`app/loop.py`\n"
    assert layout_section(readme) == section
