"""README's and docs/axolotl.md's table of what becomes of each Axolotl key is generated from the
config's own tables (functional_pp/config/keys_table.py): the committed tables equal the generated
one, and the table says what the config does with a key of each kind (taken under our name,
accepted with its reason in the start-up summary, refused naming it)."""
import re
from pathlib import Path

import pytest

from functional_pp.config import ConfigError, TrainConfig, aliases, keys_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["README.md", "docs/axolotl.md"])
def test_committed_table_is_the_generated_one(name):
    text = (ROOT / name).read_text()
    m = re.search(re.escape(keys_table.BEGIN) + r".*?" + re.escape(keys_table.END), text, re.S)
    assert m, f"{name}: no generated Axolotl keys table (markers {keys_table.BEGIN!r} ... {keys_table.END!r})"
    assert m.group(0) == keys_table.block(), f"{name}'s Axolotl keys table is stale: python -m " \
                                              f"functional_pp.config.keys_table --write"


def _kind(word: str) -> str:
    return next(keys for kind, _, keys in keys_table.rows() if word in kind)


def test_each_kind_is_what_the_config_does_with_it():
    """One key of each listed kind, read by TrainConfig: an alias lands on its target, a key of no
    effect is named in the start-up summary, a refused key is refused by name before any work."""
    for key, (target, _) in aliases.ALIASES.items():
        assert f"`{key} -> {target}`" in _kind("another name")
    assert TrainConfig.from_dict({"context_parallel_size": 2}).cp_size == 2
    unused = "device_map"
    assert f"`{unused}`" in _kind("without effect")
    assert any(unused in note for note in TrainConfig.from_dict({unused: "auto"}).notes)
    for key in aliases.UNSUPPORTED:
        assert f"`{key}`" in _kind("naming the feature")
    with pytest.raises(ConfigError, match="push_to_hub"):
        TrainConfig.from_dict({"push_to_hub": True})
    assert "`trackio_*`" in _kind("by prefix")
    with pytest.raises(ConfigError, match="trackio_project"):
        TrainConfig.from_dict({"trackio_project": "x"})
