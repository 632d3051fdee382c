"""A schedule run on paper: each device executes its actions in order, a receive waits for its
send, compute actions take unit slots (``F`` 1, ``B`` 2, ``BI`` 1, ``BW`` 1). :func:`simulate`
checks the schedule while it runs it (deadlock-freedom, every forward and backward exactly once
on the right device, every input there before it is used) and returns the executed
:class:`Timeline`, whose idle slots are the bubble and whose live activations are the memory
bound (docs/pipelines.md)."""
from __future__ import annotations

from dataclasses import dataclass

from functional_pp.parallel.pipeline.schedule import COMPUTE, Action, Schedule

DURATION = {"F": 1, "B": 2, "BI": 1, "BW": 1}


class ScheduleError(ValueError):
    """A schedule that deadlocks, misses or repeats work, or uses an input before it has it."""


@dataclass(frozen=True)
class Timeline:
    """The executed schedule: per device its compute actions as (start, end, action)."""
    schedule: Schedule
    slots: tuple[tuple[tuple[int, int, Action], ...], ...]

    @property
    def makespan(self) -> int:
        return max((end for dev in self.slots for _, end, _ in dev), default=0)

    def busy(self, device: int) -> int:
        return sum(end - start for start, end, _ in self.slots[device])

    @property
    def bubble(self) -> float:
        """Idle slots over all slots (every device, from 0 to the makespan)."""
        p, span = len(self.slots), self.makespan
        return 1.0 - sum(self.busy(d) for d in range(p)) / (p * span)

    def in_flight(self, device: int) -> int:
        """Peak number of (virtual stage, micro-batch) activations held on ``device``: from the
        start of a forward to the end of its backward (of ``BW`` when the backward is split)."""
        freed_by = "BW" if self.schedule.split_backward else "B"
        events = []
        for start, end, a in self.slots[device]:
            if a.kind == "F":
                events.append((start, 1))
            elif a.kind == freed_by:
                events.append((end, -1))
        peak = live = 0
        for _, delta in sorted(events):            # at one time a release comes first (-1 < 1)
            live += delta
            peak = max(peak, live)
        return peak

    def held_peak(self, device: int, activation: float, gradients: float) -> float:
        """Peak of what ``device`` holds over the step: ``activation`` per (virtual stage,
        micro-batch) from the start of its forward to the end of its backward (as
        :meth:`in_flight`), and ``gradients`` per virtual stage from the start of its first
        backward to the end of its last (a stage's unsharded gradients accumulate over its
        micro-batches and are reduced and freed after the last: an interleaved schedule frees one
        model chunk's before another's are complete)."""
        freed_by = "BW" if self.schedule.split_backward else "B"
        grads = ("B", "BI", "BW")
        events = []
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for start, end, a in self.slots[device]:
            if a.kind == "F":
                events.append((start, activation))
            elif a.kind == freed_by:
                events.append((end, -activation))
            if a.kind in grads:
                first[a.stage] = min(first.get(a.stage, start), start)
                last[a.stage] = max(last.get(a.stage, end), end)
        events += [(t, gradients) for t in first.values()] + [(t, -gradients) for t in last.values()]
        peak = live = 0.0
        for _, delta in sorted(events):            # at one time a release comes first
            live += delta
            peak = max(peak, live)
        return peak

    def text(self) -> str:
        """One row per device, one column per slot: ``F3`` forward of micro-batch 3 (``F3:1`` in
        model chunk 1 when interleaved), ``.`` idle."""
        s = self.schedule
        grid = [["."] * self.makespan for _ in self.slots]
        for d, dev in enumerate(self.slots):
            for start, end, a in dev:
                label = f"{a.kind}{a.micro}" + (f":{a.stage // s.stages}" if s.virtual > 1 else "")
                for t in range(start, end):
                    grid[d][t] = label
        width = max((len(c) for row in grid for c in row), default=1)
        head = f"{s.name} p={s.stages} v={s.virtual} m={s.micro}: makespan {self.makespan}, bubble {self.bubble:.3f}"
        return "\n".join([head] + [f"device {d}: " + " ".join(c.ljust(width) for c in row)
                                   for d, row in enumerate(grid)])


def simulate(schedule: Schedule) -> Timeline:
    """Run ``schedule`` (buffered sends, blocking receives); raise :class:`ScheduleError` on a
    deadlock, missing or repeated work, work on the wrong device, or an input used too early."""
    s = schedule
    p, last = s.stages, s.virtual_stages - 1
    acts = s.actions
    if len(acts) != p:
        raise ScheduleError(f"{s.name}: {len(acts)} action lists for {p} devices")
    ptr, clock = [0] * p, [0] * p
    have: list[set] = [set() for _ in range(p)]           # inputs present on a device
    sent: dict[tuple, tuple[int, int]] = {}               # message -> (time, sender)
    received: set = set()
    done: dict[tuple, int] = {}                            # (kind, stage, micro) -> end time
    slots: list[list] = [[] for _ in range(p)]

    def message(a: Action) -> tuple:
        return {"SEND_F": ("act", a.stage, a.micro), "RECV_F": ("act", a.stage - 1, a.micro),
                "SEND_B": ("grad", a.stage, a.micro), "RECV_B": ("grad", a.stage + 1, a.micro)}[a.kind]

    def needs(a: Action) -> list[tuple]:
        k, j = a.stage, a.micro
        if a.kind == "F":
            return [("act", k - 1, j)] if k > 0 else []
        if a.kind in ("B", "BI"):
            return [("out", k, j)] + ([("grad", k + 1, j)] if k < last else [])
        return [("bi", k, j)]                                 # BW after its BI

    def run(d: int, a: Action) -> bool:
        if a.kind in COMPUTE:
            if s.device_of(a.stage) != d:
                raise ScheduleError(f"{s.name}: {a} on device {d}; virtual stage {a.stage} runs on device "
                                    f"{s.device_of(a.stage)}")
            missing = [n for n in needs(a) if n not in have[d]]
            if missing:
                raise ScheduleError(f"{s.name}: {a} on device {d} runs before it has {missing[0]} "
                                    f"(a receive or an earlier action is missing)")
            key = (a.kind, a.stage, a.micro)
            if key in done:
                raise ScheduleError(f"{s.name}: {a} runs twice")
            start = clock[d]
            clock[d] = start + DURATION[a.kind]
            done[key] = clock[d]
            slots[d].append((start, clock[d], a))
            k, j = a.stage, a.micro
            if a.kind == "F":
                have[d].update({("out", k, j), ("act", k, j)})
            elif a.kind in ("B", "BI"):
                have[d].update({("grad", k, j), ("bi", k, j)})
            return True
        msg = message(a)
        if a.kind.startswith("SEND"):
            if msg not in have[d]:
                raise ScheduleError(f"{s.name}: {a} on device {d} sends {msg} before computing it")
            if msg in sent:
                raise ScheduleError(f"{s.name}: {a} sends {msg} twice")
            sent[msg] = (clock[d], d)
            return True
        if msg not in sent:
            return False                                   # blocked: wait for the send
        t, sender = sent[msg]
        if sender != a.peer:
            raise ScheduleError(f"{s.name}: {a} on device {d} expects {msg} from device {a.peer}, "
                                f"device {sender} sent it")
        clock[d] = max(clock[d], t)
        have[d].add(msg)
        received.add(msg)
        return True

    progress = True
    while progress:
        progress = False
        for d in range(p):
            while ptr[d] < len(acts[d]) and run(d, acts[d][ptr[d]]):
                ptr[d] += 1
                progress = True
    blocked = [f"device {d} at {acts[d][ptr[d]]}" for d in range(p) if ptr[d] < len(acts[d])]
    if blocked:
        raise ScheduleError(f"{s.name}: deadlock, every remaining device waits: " + "; ".join(blocked))
    split = s.split_backward
    for k in range(s.virtual_stages):
        for j in range(s.micro):
            want = [("F", k, j)] + ([("BI", k, j), ("BW", k, j)] if split else [("B", k, j)])
            lost = [w for w in want if w not in done]
            if lost:
                raise ScheduleError(f"{s.name}: {lost[0][0]} of micro-batch {j} on virtual stage {k} never runs")
    if set(sent) - received:
        raise ScheduleError(f"{s.name}: sent but never received: {sorted(set(sent) - received)[:3]}")
    return Timeline(s, tuple(tuple(dev) for dev in slots))


def bubble_formula(name: str, stages: int, micro: int, virtual: int = 1) -> float:
    """The bubble of a schedule in unit slots: (p - 1) / (m + p - 1) for GPipe and 1F1B,
    (p - 1) / (v m + p - 1) interleaved, (p - 1) / (3 m + p - 1) for ZB-H1 (forward, input and
    weight gradient of equal time: a third of 1F1B's idle time)."""
    p, m, v = stages, micro, virtual
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)
