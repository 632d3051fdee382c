"""GRPO's prompts (functional_pp/data/prompts.py): records as they are or through Axolotl's
user-defined transform (imported from the config's directory; ``remove_columns``; the entry's
index), texts tokenized with the tokenizer's special tokens and conversations rendered with the
chat template's generation prompt, the other columns kept for the reward functions, prompts too
long left out and counted; bad records refused naming the record; the loader's steps the same
for any device and resumable."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from functional_pp.config.sections import DatasetConfig
from functional_pp.data.chat import render
from functional_pp.data.formats import ByteTokenizer
from functional_pp.data.prompts import PromptLoader, build_prompts
from functional_pp.data.tokenizer import CHATML

TRANSFORM = '''
def to_chat(cfg, dataset_idx=None, **kwargs):
    seen.append((cfg["sequence_len"], dataset_idx))
    def transform(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["q"]}], "answer": example["a"],
                "tok": type(tokenizer).__name__}
    return transform, {"remove_columns": ["q"]}


seen = []
'''


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_texts_and_transformed_conversations(tmp_path):
    plain = _write(tmp_path / "plain.jsonl", [{"prompt": "hi", "answer": 1}, {"prompt": "x" * 60, "answer": 2}])
    (tmp_path / "qa_transform.py").write_text(TRANSFORM)
    chat = _write(tmp_path / "qa.jsonl", [{"q": "why?", "a": 3}])
    entries = [DatasetConfig(path=str(plain)), DatasetConfig(path=str(chat), type="qa_transform.to_chat")]
    tok = ByteTokenizer()
    ps = build_prompts(entries, tok, seq_len=64, max_completion_length=8, cfg={"sequence_len": 64},
                       config_dir=tmp_path)
    assert len(ps) == 2 and ps.dropped == 1                     # the 60-byte prompt leaves no room
    first, second = ps.prompts
    assert first.ids == list(b"hi") and first.raw == "hi" and first.columns == {"answer": 1}
    want = render(CHATML, [{"role": "user", "content": "why?"}], {}, add_generation_prompt=True)[0]
    assert second.ids == list(want.encode()) and want.endswith("<|im_start|>assistant\n")
    assert second.columns == {"a": 3, "answer": 3, "tok": "ByteTokenizer"}     # q removed
    import qa_transform
    assert qa_transform.seen == [(64, 1)]


def test_bad_records_and_transforms_are_refused(tmp_path):
    tok = ByteTokenizer()
    f = _write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"question": "q"}])
    with pytest.raises(ValueError, match=r"bad.jsonl: record 2 has no field 'prompt' \(its fields: \['question'\]\)"):
        build_prompts([DatasetConfig(path=str(f))], tok, seq_len=32, max_completion_length=8)
    g = _write(tmp_path / "odd.jsonl", [{"prompt": 3}])
    with pytest.raises(ValueError, match="record 1: the prompt must be a text or a list of messages"):
        build_prompts([DatasetConfig(path=str(g))], tok, seq_len=32, max_completion_length=8)
    with pytest.raises(ValueError, match=r"datasets\[0\].type: cannot import module 'no_such_module'"):
        build_prompts([DatasetConfig(path=str(g), type="no_such_module.f")], tok, seq_len=32, max_completion_length=8)
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        build_prompts([DatasetConfig(path=str(g))], tok, seq_len=8, max_completion_length=8)


def test_the_loader_gives_every_device_the_same_prompts_and_resumes(tmp_path):
    f = _write(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    ps = build_prompts([DatasetConfig(path=str(f))], ByteTokenizer(), seq_len=16, max_completion_length=4)
    a, b = PromptLoader(ps, prompts_per_step=3, seed=5), PromptLoader(ps, prompts_per_step=3, seed=5)
    steps = [[p.raw for p in next(a)] for _ in range(4)]
    assert len(a) == 3 and len(set(sum(steps[:3], []))) == 9          # an epoch: each prompt at most once
    b.load_state_dict({**a.state_dict(), "step": 2, "generation_key": 11})
    assert [p.raw for p in next(b)] == steps[2] and b.generation_key == 11
    with pytest.raises(ValueError, match="10 prompts .* are fewer than one step's 12"):
        PromptLoader(ps, prompts_per_step=12)


def test_a_module_beside_the_config_wins_over_one_of_that_name_imported_before(tmp_path):
    from functional_pp.data.prompts import import_dotted
    for sub, body in (("one", "def f():\n    return 1\n"), ("two", "def g():\n    return 2\n")):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "fpp_reward_stand_in.py").write_text(body)
    assert import_dotted("fpp_reward_stand_in.f", "reward", "trl.reward_funcs[0]", (tmp_path / "one",))() == 1
    assert import_dotted("fpp_reward_stand_in.g", "reward", "trl.reward_funcs[0]", (tmp_path / "two",))() == 2
