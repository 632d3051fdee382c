"""Pipeline schedules as data: every schedule checked by running it on paper (no deadlock,
every forward and backward once, inputs before use), its bubble measured from the executed
timeline equal to the formula, its in-flight activations within its bound; a broken schedule
is refused, naming what is wrong."""
import dataclasses

import pytest

from functional_pp.parallel.pipeline.schedule import SCHEDULES, Action, build, check_sizes
from functional_pp.parallel.pipeline.timing import ScheduleError, bubble_formula, simulate

SIZES = [(1, 3), (2, 2), (2, 5), (4, 4), (4, 8), (3, 9)]          # (stages p, micro-batches m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
@pytest.mark.parametrize("p,m", SIZES)
def test_bubble_equals_formula(name, p, m):
    t = simulate(build(name, p, m))
    assert t.bubble == pytest.approx(bubble_formula(name, p, m), abs=1e-12)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (4, 8, 2), (4, 4, 4), (3, 6, 2)])
def test_interleaved_bubble_equals_formula(p, m, v):
    t = simulate(build("interleaved_1f1b", p, m, v))
    assert t.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert t.bubble < simulate(build("1f1b", p, m)).bubble or p == 1


@pytest.mark.parametrize("p,m", [(2, 5), (4, 4), (4, 8), (3, 9)])
def test_in_flight_bounds(p, m):
    one = simulate(build("1f1b", p, m))
    assert [one.in_flight(d) for d in range(p)] == [min(p - d, m) for d in range(p)]   # 1F1B: p on stage 0
    assert all(simulate(build("gpipe", p, m)).in_flight(d) == m for d in range(p))   # GPipe: all m
    zb = simulate(build("zb_h1", p, m))
    assert max(zb.in_flight(d) for d in range(p)) <= 2 * p - 1        # until BW: p + p deferred W at most
    assert zb.bubble < one.bubble or p == 1


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (8, 8), (4, 8)])
def test_held_peak_counts_each_chunks_gradients_while_they_accumulate(p, m):
    """Activations as ``in_flight``; a model chunk's unsharded gradients from its first backward
    to its last. 1F1B holds its whole stage's gradients at its first backward, with p
    micro-batches' activations; interleaved 1F1B with m = p (torchtitan's 405B row) holds the same
    activations but only the chunk whose backward has begun: half its stage's gradients less."""
    one = simulate(build("1f1b", p, m))
    two = simulate(build("interleaved_1f1b", p, m, 2))
    for t, v in ((one, 1), (two, 2)):
        assert all(t.held_peak(d, 1.0 / v, 0.0) == t.in_flight(d) / v for d in range(p))
    assert one.held_peak(0, 1.0, 2.0) == p + 2
    if m == p:
        assert two.held_peak(0, 0.5, 1.0) == p + 1                                  # half the stage's gradients
    assert simulate(build("gpipe", p, m)).held_peak(0, 1.0, 2.0) == m + 2        # all forwards before a backward


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_action_once_with_its_sends(name):
    p, m, v = 4, 8, 2 if name == "interleaved_1f1b" else 1
    s = build(name, p, m, v)
    compute = [(a.kind, a.stage, a.micro) for acts in s.actions for a in acts if a.kind in ("F", "B", "BI", "BW")]
    kinds = ("F", "BI", "BW") if name == "zb_h1" else ("F", "B")
    assert sorted(compute) == sorted((k, st, j) for k in kinds for st in range(p * v) for j in range(m))
    sends = sum(a.kind.startswith("SEND") for acts in s.actions for a in acts)
    assert sends == sum(a.kind.startswith("RECV") for acts in s.actions for a in acts) == 2 * (p * v - 1) * m


def _edit(s, device, fn):
    acts = list(s.actions)
    acts[device] = tuple(fn(list(acts[device])))
    return dataclasses.replace(s, actions=tuple(acts))


def test_broken_schedules_are_refused():
    s = build("1f1b", 2, 2)
    no_recv = _edit(s, 1, lambda a: [x for x in a if not (x.kind == "RECV_F" and x.micro == 0)])
    with pytest.raises(ScheduleError, match="before it has"):
        simulate(no_recv)
    twice = _edit(s, 0, lambda a: a + [Action("F", 0, 0)])
    with pytest.raises(ScheduleError, match="twice"):
        simulate(twice)
    lost = _edit(s, 0, lambda a: [x for x in a if not (x.kind == "B" and x.micro == 1)])
    with pytest.raises(ScheduleError, match="never runs"):
        simulate(lost)
    # both devices receive before they send: a deadlock, named with where each one waits
    swapped = _edit(s, 0, lambda a: [Action("RECV_B", 0, 0, 1)] + a)
    with pytest.raises(ScheduleError, match="deadlock.*device 0 at RECV_B"):
        simulate(swapped)
    wrong = _edit(s, 0, lambda a: [Action("F", 1, 5)] + a)
    with pytest.raises(ScheduleError, match="runs on device 1"):
        simulate(wrong)


def test_bad_sizes_and_names_are_refused():
    with pytest.raises(ValueError, match="unknown schedule '1F1B'.*Did you mean '1f1b'"):
        build("1F1B", 2, 4)
    with pytest.raises(ValueError, match="divisible by the stages"):
        build("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="need pp_schedule 'interleaved_1f1b'"):
        build("1f1b", 2, 4, virtual=2)
    with pytest.raises(ValueError, match="layers do not split into 4 stages x 2"):
        check_sizes("interleaved_1f1b", 4, 2, 8, layers=12)


def test_printed_timeline():
    text = simulate(build("1f1b", 2, 2)).text()
    assert text.splitlines() == [
        "1f1b p=2 v=1 m=2: makespan 9, bubble 0.333",
        "device 0: F0 F1 .  .  B0 B0 .  B1 B1",
        "device 1: .  F0 B0 B0 F1 B1 B1 .  . "]
    assert "F0@0->1" in str(build("1f1b", 2, 2))
