"""The package's docstrings and comments cite files of this repository (``docs/*.md``,
``tests/...``, ``benchmarks/...``, ``examples/...``) that exist, and never an external guide:
the semantics and formulas the code relies on live in ``docs/`` (docs/README.md)."""
from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
CITED = re.compile(r"\b((?:docs|tests|benchmarks|examples)/[A-Za-z0-9_./-]+\.(?:md|py))")
EXTERNAL = re.compile(r"\bguide\b", re.IGNORECASE)


def cited_paths(text: str) -> set[str]:
    return set(CITED.findall(text))


def broken_references(root: pathlib.Path, repo: pathlib.Path) -> list[str]:
    """``file: path`` for every cited repository path under ``root`` that does not exist."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        for path in sorted(cited_paths(f.read_text())):
            if not (repo / path).is_file():
                bad.append(f"{f.relative_to(repo)}: {path}")
    return bad


def test_cited_repository_files_exist():
    bad = broken_references(REPO / "functional_pp", REPO)
    assert not bad, "the package cites files that are not in the repository:\n" + "\n".join(bad)


def test_no_external_guide_is_cited():
    hits = [f"{f.relative_to(REPO)}:{i}: {line.strip()}"
            for f in sorted((REPO / "functional_pp").rglob("*.py"))
            for i, line in enumerate(f.read_text().splitlines(), 1) if EXTERNAL.search(line)]
    assert not hits, "cite a file under docs/ instead of a guide:\n" + "\n".join(hits)


def test_checker_sees_a_broken_reference(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    (tmp_path / "pkg" / "m.py").write_text('"""See docs/here.md and docs/gone.md (tests/test_x.py)."""\n')
    assert broken_references(tmp_path / "pkg", tmp_path) == ["pkg/m.py: docs/gone.md", "pkg/m.py: tests/test_x.py"]
    assert EXTERNAL.search("per the design guide, section 3") and not EXTERNAL.search("guided")
