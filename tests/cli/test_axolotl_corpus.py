"""Axolotl's example configs as written (tests/data/axolotl_examples/corpus/, Apache-2.0), edited
only in paths and sizes by tests/axolotl_corpus.py: the classification of every config (accepted,
or the features that refuse it) equals the committed table expected.yaml; no refusal is a bare
"unknown key"; every accepted config validates, and one per architecture (a LoRA one where there
is one; not one that compiles, whose inductor compile alone takes minutes here) and every reward
model trains 2 steps on
simulated devices (a tiny model per architecture, shared); README's counts are the table's."""
import json
import re
from pathlib import Path

import pytest
import yaml
from axolotl_corpus import ACCEPTED, CORPUS, EXPECTED, MODEL_TYPES, classify, corpus_files, counts, top_kinds

from functional_pp import cli

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """name -> (classification, edited config file or None, devices)."""
    root = tmp_path_factory.mktemp("corpus")
    out = {}
    for i, name in enumerate(corpus_files()):
        d = root / f"c{i:03d}"
        d.mkdir()
        out[name] = classify(name, d, root / "models")
    return out


def test_classification_equals_the_committed_table(corpus):
    got = {name: v[0] for name, v in corpus.items()}
    want = yaml.safe_load(EXPECTED.read_text())
    changed = {n: {"committed": want.get(n), "now": got.get(n)} for n in sorted(set(got) | set(want))
               if want.get(n) != got.get(n)}
    assert not changed, (f"{len(changed)} corpus configs changed classification (after a deliberate "
                         f"change: python tests/axolotl_corpus.py --write):\n"
                         + yaml.safe_dump(changed, width=120))


def test_every_refusal_names_a_feature(corpus):
    generic = {n: r for n, (v, _, _) in corpus.items() if v != ACCEPTED
               for r in v if r.startswith("unknown key") or len(r) > 80}
    assert not generic, generic


def _steps(out: Path) -> list[int]:
    return [m["step"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def _trained(accepted: dict) -> set[str]:
    """One accepted config per architecture: a LoRA one where there is one, none that compiles;
    every reward-model config (a head and an objective of their own); and one config with images
    (``processor_type``: the vision encoder and its data) per architecture."""
    chosen: dict[str, tuple[bool, str]] = {}
    for name in sorted(accepted):
        raw = yaml.safe_load((CORPUS / name).read_text())
        if raw.get("torch_compile"):
            continue
        if raw.get("reward_model") or raw.get("process_reward_model"):
            chosen[name] = (True, name)
            continue
        arch, lora = MODEL_TYPES.get(raw["base_model"], raw["base_model"]), raw.get("adapter") == "lora"
        if raw.get("processor_type"):
            arch += " with images"
        if arch not in chosen or (lora and not chosen[arch][0]):
            chosen[arch] = (lora, name)
    return {name for _, name in chosen.values()}


def test_accepted_configs_validate_and_one_per_architecture_trains_two_steps(corpus, capsys):
    accepted = {n: (path, dev) for n, (v, path, dev) in corpus.items() if v == ACCEPTED}
    assert accepted, "no corpus config is accepted"
    for name, (path, devices) in accepted.items():
        assert cli.main(["validate", str(path), "--simulate", str(devices)]) == 0, name
    for name in sorted(_trained(accepted)):
        path, devices = accepted[name]
        assert cli.main(["train", str(path), "--simulate", str(devices)]) == 0, name
        out = Path(yaml.safe_load(path.read_text())["output_dir"])
        assert _steps(out) == [1, 2], name
        capsys.readouterr()


def test_readme_counts_are_the_tables():
    n, kinds = counts(yaml.safe_load(EXPECTED.read_text()))
    text = README.read_text()
    m = re.search(r"Axolotl's example configs: (\d+) of (\d+) accepted", text)
    assert m and (int(m.group(1)), int(m.group(2))) == (n, len(corpus_files())), m and m.group(0)
    row = re.search(r"refused by \(configs\): (.*)\n", text).group(1)
    assert dict((k, int(v)) for v, k in re.findall(r"(\d+) `([^`]+)`", row)) == dict(top_kinds(kinds))
