"""A long data preparation says how far it is (rows, tokens, rates) on stderr, at a bounded
rate; a short one says nothing. The clock is injected: no test waits."""
import io
import json

from functional_pp.config import DatasetConfig
from functional_pp.data.formats import build_streams
from functional_pp.data.progress import Progress


class Clock:
    """Each read advances by ``tick`` seconds."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_silent_while_short_then_bounded_lines_with_rates():
    out = io.StringIO()
    p = Progress("preparing data (x.jsonl)", 40, stream=out, clock=Clock(0.25), after=5.0, every=10.0)
    for i in range(1, 41):
        p.update(i, 7 * i)
    p.finish()
    lines = out.getvalue().splitlines()
    # 10 s of reads: the first line past 5 s, the last at the end, nothing in between (every 10 s)
    assert lines == ["preparing data (x.jsonl): 20 of 40 rows, 140 tokens in 5 s (4 rows/s, 28 tokens/s)",
                     "preparing data (x.jsonl): done: 40 of 40 rows, 280 tokens in 10 s (4 rows/s, 27 tokens/s)"]


def test_a_short_preparation_prints_nothing():
    out = io.StringIO()
    p = Progress("preparing data", stream=out, clock=Clock(0.001))
    for i in range(1, 101):
        p.update(i, i)
    p.finish()
    assert out.getvalue() == ""


def test_lines_are_bounded_however_many_rows():
    out = io.StringIO()
    p = Progress("preparing data", stream=out, clock=Clock(1.0), after=5.0, every=10.0)
    for i in range(1, 101):                 # 100 s: a line at 5 s, then one per 10 s, then the last
        p.update(i, i)
    p.finish()
    assert len(out.getvalue().splitlines()) == 1 + 9 + 1


def test_build_streams_reports_its_progress(tmp_path):
    rows = [{"text": f"row {i} " * 3} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    entries = [DatasetConfig(path=str(tmp_path / "d.jsonl"))]
    out = io.StringIO()
    train, _ = build_streams(entries, None, seq_len=64, progress_stream=out, clock=Clock(1.0))
    lines = out.getvalue().splitlines()
    tokens = sum(s.tokens for s in train.stats)
    assert lines[0].startswith("preparing data (d.jsonl): ") and " of 40 rows, " in lines[0]
    assert lines[-1].startswith(f"preparing data (d.jsonl): done: 40 of 40 rows, {tokens:,} tokens in ")
    assert 2 < len(lines) <= 2 + 40 // 10
    quiet = io.StringIO()
    build_streams(entries, None, seq_len=64, progress_stream=quiet)       # this machine's clock: short
    assert quiet.getvalue() == ""
