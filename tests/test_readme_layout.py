"""README.md's "Layout of the code" names every folder of the package (each directory with an
``__init__.py`` directly under ``functional_pp/``) as `` `name/` ``, and names no folder that
does not exist. Module-level detail lives in docs/architecture.md."""
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


def folders(root: pathlib.Path) -> set[str]:
    """The package's folders: directories directly under ``root`` holding an ``__init__.py``."""
    return {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def named_folders(section: str) -> set[str]:
    """Folders the section names in backticks with a trailing slash (`` `core/` ``)."""
    return set(re.findall(r"`([A-Za-z0-9_]+)/`", section))


def test_readme_layout_names_every_folder_and_no_other():
    named = named_folders(layout_section((REPO / "README.md").read_text()))
    have = folders(REPO / PACKAGE)
    assert not have - named, f"README.md '{TITLE[3:]}' does not name these folders of {PACKAGE}/: {sorted(have - named)}"
    assert not named - have, f"README.md '{TITLE[3:]}' names folders that do not exist: {sorted(named - have)}"


def test_checker_sees_a_missing_and_a_stale_folder(tmp_path):
    for name, init in [("core", True), ("ops", True), ("notes", False)]:
        (tmp_path / name).mkdir()
        if init:
            (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "version.py").write_text("")
    section = "## Layout of the code\n\n| folder | job |\n|---|---|\n| `core/` | x |\n| `old/` | gone |\n"
    assert folders(tmp_path) == {"core", "ops"}
    assert named_folders(section) == {"core", "old"}
    assert layout_section("# x\n" + section + "\n## Next\n`ops/`\n") == section
