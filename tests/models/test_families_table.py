"""The supported-families table (docs/models.md, README) is generated from the registry
(functional_pp/models/families_table.py): the committed tables equal the generated one, every
``model_type`` that imports has its row, and every family refused by name is refused with its
reason when its config.json is read."""
import re
from pathlib import Path

import pytest

from functional_pp.checkpoint import hf
from functional_pp.models import families_table, llama_hf
from functional_pp.models.hf_switches import REFUSED

ROOT = Path(__file__).resolve().parents[2]


def _committed(path: Path) -> str:
    text = path.read_text()
    m = re.search(re.escape(families_table.BEGIN) + r".*?" + re.escape(families_table.END), text, re.S)
    assert m, f"{path.name}: no generated families table (the markers {families_table.BEGIN!r} ... {families_table.END!r})"
    return m.group(0)


def test_docs_table_is_the_generated_one():
    assert _committed(ROOT / "docs" / "models.md") == families_table.block(), (
        "docs/models.md's families table is stale: python -m functional_pp.models.families_table --write")


def test_readme_table_is_the_generated_one():
    readme = ROOT / "README.md"
    if families_table.BEGIN not in readme.read_text():
        pytest.skip("README.md has no generated families table yet: paste `python -m "
                    "functional_pp.models.families_table`'s output in place of its table")
    assert _committed(readme) == families_table.block(), (
        "README.md's families table is stale: python -m functional_pp.models.families_table --write")


def test_every_family_has_one_row_with_its_class_and_presets():
    text = families_table.table()
    for mt in llama_hf.MODEL_TYPES:
        assert f"`{llama_hf.ARCHITECTURES[mt]}`" in text, mt
    row = next(line for line in text.splitlines() if line.startswith("| `qwen3` |"))
    assert "`qwen3-0.6b`, `qwen3-8b`" in row


def test_a_family_without_a_row_is_refused(monkeypatch):
    rows = tuple(r for r in families_table.ROWS if "nemotron" not in r.model_types)
    monkeypatch.setattr(families_table, "ROWS", rows)
    with pytest.raises(ValueError, match=r"missing \['nemotron'\]"):
        families_table.table()
    monkeypatch.setattr(families_table, "ROWS", rows + (families_table.Row(("llama",), "again"),))
    with pytest.raises(ValueError, match=r"listed twice \['llama'\]"):
        families_table.table()


@pytest.mark.parametrize("mt", sorted(REFUSED))
def test_refused_families_are_named(mt):
    assert mt not in llama_hf.MODEL_TYPES
    with pytest.raises(ValueError, match=rf"model_type {mt!r} is not supported \({re.escape(REFUSED[mt])}\)"):
        hf.config_from_hf(dict(model_type=mt, vocab_size=256, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=128))
    assert f"`{mt}`" in families_table.refused_line()
