"""A resumed run trains on the tokens its checkpoint was trained on (issue 46): the loader state
saved with a checkpoint holds a hash of the token stream and its trained flags; resuming after a
data file was rewritten (same size, so the same token count) continued at step N of other data,
exit 0. It is refused naming both hashes; ``--allow-config-change`` continues anyway."""
import json

import numpy as np
import pytest
import yaml

from functional_pp import cli
from functional_pp.data import DataLoader
from functional_pp.data.loader import tokens_digest


def _rows(answer: str) -> str:
    return "".join(json.dumps({"instruction": f"Add {i} and {i}.", "input": "", "output": answer}) + "\n"
                   for i in range(12))


def test_resume_on_rewritten_data_is_refused(tmp_path, capsys):
    data = tmp_path / "a.jsonl"
    data.write_text(_rows("42"))
    # (train_on_inputs: the 32-byte windows hold prompt tokens only; a run that trains none is refused)
    cfg = {"model": "tiny", "micro_batch_size": 2, "sequence_len": 32, "max_steps": 1, "lr_scheduler": "constant",
           "train_on_inputs": True, "datasets": [{"path": str(data), "type": "alpaca"}],
           "output_dir": str(tmp_path / "out")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", str(tmp_path / "c.yaml"), "--simulate", "1"]) == 0
    data.write_text(_rows("24"))                                      # same size, other tokens
    capsys.readouterr()
    args = ["train", str(tmp_path / "c.yaml"), "--simulate", "1", "--resume", "--set", "max_steps=2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--resume: the training tokens differ from the ones" in err and "step-000001 was trained on" in err
    assert "--allow-config-change" in err and not (tmp_path / "out/checkpoints/step-000002").exists()
    assert cli.main([*args, "--allow-config-change"]) == 0
    assert (tmp_path / "out/checkpoints/step-000002").exists()


def test_loader_state_holds_the_tokens_hash():
    tokens = np.arange(200) % 50
    saved = DataLoader(tokens, global_batch_size=2, seq_len=8).state_dict()
    assert saved["tokens_sha256"] == tokens_digest(tokens)
    other = tokens.copy()
    other[100] = 7
    with pytest.raises(ValueError, match="the training tokens differ"):
        DataLoader(other, global_batch_size=2, seq_len=8).load_state_dict(saved)
    DataLoader(other, global_batch_size=2, seq_len=8).load_state_dict(saved, check_tokens=False)
    flags = np.ones(200, dtype=bool)
    assert DataLoader(tokens, global_batch_size=2, seq_len=8, trained=flags).digest() != saved["tokens_sha256"]


def test_beyond_2_24_tokens_the_hash_samples_the_head_the_tail_and_spread_tokens():
    """A stream longer than DIGEST_WHOLE is hashed by its length, first and last 2^20 tokens and
    2^16 spread evenly (a memory-mapped corpus is not read whole): the reference written from that
    definition; a change there (or of the length) changes it, one between samples does not."""
    import hashlib

    from functional_pp.data.loader import DIGEST_WHOLE
    n = DIGEST_WHOLE + 1000
    tokens = (np.arange(n, dtype=np.int64) % 65521).astype(np.uint16)
    spread = np.linspace(0, n - 1, 1 << 16).astype(np.int64)
    h = hashlib.sha256(str(n).encode())
    h.update(b"uint16")
    for part in (tokens[:1 << 20], tokens[-(1 << 20):], tokens[spread]):
        h.update(np.ascontiguousarray(part))
    h.update(b"none")
    assert tokens_digest(tokens) == h.hexdigest()[:16]
    for at in (5, n - 5, int(spread[40000])):              # the head, the tail, a spread sample
        other = tokens.copy()
        other[at] ^= 1
        assert tokens_digest(other) != tokens_digest(tokens), at
    between = int(spread[40000]) + 1                        # neither head, tail nor a sample
    assert between not in set(spread.tolist()) and (1 << 20) < between < n - (1 << 20)
    other = tokens.copy()
    other[between] ^= 1
    assert tokens_digest(other) == tokens_digest(tokens)
    assert tokens_digest(tokens[:-1]) != tokens_digest(tokens)
