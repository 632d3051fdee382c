"""Every code block of README.md and docs/*.md runs, or is a marked fragment checked for syntax,
so the docs cannot go stale: a ```python block runs in a fresh interpreter (its own process,
in a scratch directory); one preceded by ``<!-- fragment -->`` (an excerpt that needs its
surroundings) is compiled only; a ```bash block must parse (``bash -n``); a ```yaml block must
load."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
FRAGMENT = "<!-- fragment -->"


def blocks() -> list[tuple[str, str, str, bool]]:
    """``(where, language, code, fragment)`` of every fenced block with a language."""
    out = []
    for f in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = f.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip().splitlines()[-1:] or [""]
            out.append((f"{f.relative_to(REPO)}:{line}", m.group(1), m.group(2), before[0].strip() == FRAGMENT))
    return out


BLOCKS = blocks()


def test_the_docs_have_code_blocks():
    assert sum(lang == "python" and not frag for _, lang, _, frag in BLOCKS) >= 2


@pytest.mark.parametrize("where,lang,code,fragment", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block(where, lang, code, fragment, tmp_path):
    if lang == "python" and fragment:
        compile(code, where, "exec")
    elif lang == "python":
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
        assert run.returncode == 0, f"{where} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    elif lang in ("bash", "sh"):
        run = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"{where}: {run.stderr}"
    elif lang in ("yaml", "yml"):
        yaml.safe_load(code)
    else:
        pytest.skip(f"{where}: no check for ```{lang} blocks")
