"""Pipeline schedules as data: for ``p`` devices (stages), ``v`` virtual stages per device and
``m`` micro-batches, the ordered list of actions each device runs (docs/pipelines.md).

A model of ``L`` layers is cut into ``p * v`` virtual stages of ``L / (p * v)`` consecutive
layers; virtual stage ``k`` runs on device ``k % p`` (its model chunk ``k // p``), so with
``v = 1`` stage ``k`` is device ``k``. Actions: ``F`` (forward), ``B`` (full backward),
``BI``/``BW`` (the backward split into the input gradient, sent on at once, and the weight
gradient, which may wait: zero-bubble), ``SEND_F``/``RECV_F`` (an activation to the next stage),
``SEND_B``/``RECV_B`` (its gradient to the previous stage). :func:`build` derives the lists
from a schedule name; :mod:`~functional_pp.parallel.pipeline.timing` checks and times them."""
from __future__ import annotations

import difflib
from dataclasses import dataclass

COMPUTE = ("F", "B", "BI", "BW")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class Action:
    """One step of a device: ``kind`` on virtual ``stage`` for ``micro``-batch; ``peer`` the
    device a send goes to or a receive comes from."""
    kind: str
    stage: int
    micro: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}"
        return f"{self.kind}{self.micro}@{self.stage}{peer}"


@dataclass(frozen=True)
class Schedule:
    """Per-device action lists of one pipeline step (``actions[d]`` for device ``d``)."""
    name: str
    stages: int             # p: devices along pp
    virtual: int            # v: model chunks per device
    micro: int              # m: micro-batches
    actions: tuple[tuple[Action, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.virtual

    def device_of(self, stage: int) -> int:
        """The device that runs virtual stage ``stage``."""
        return stage % self.stages

    def compute(self, device: int) -> list[Action]:
        """The compute actions of ``device`` in order."""
        return [a for a in self.actions[device] if a.kind in COMPUTE]

    @property
    def split_backward(self) -> bool:
        return any(a.kind == "BI" for acts in self.actions for a in acts)

    def __str__(self) -> str:
        rows = [f"{self.name}: p={self.stages} v={self.virtual} m={self.micro}"]
        rows += [f"  device {d}: " + " ".join(str(a) for a in acts) for d, acts in enumerate(self.actions)]
        return "\n".join(rows)


def check_sizes(name: str, stages: int, virtual: int, micro: int, layers: int | None = None) -> None:
    """Refuse a schedule name or sizes that cannot work, naming the fix."""
    if name not in SCHEDULES:
        hint = difflib.get_close_matches(str(name).lower(), SCHEDULES, n=1)
        raise ValueError(f"pp_schedule: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}"
                         + (f". Did you mean {hint[0]!r}?" if hint else ""))
    for what, n in (("stages (pipeline_parallel_size)", stages), ("virtual stages", virtual),
                    ("micro-batches (gradient_accumulation_steps)", micro)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"pipeline schedule {name!r}: {what} must be an integer >= 1, got {n!r}")
    if virtual > 1 and name != "interleaved_1f1b":
        raise ValueError(f"pipeline schedule {name!r} runs one model chunk per device; virtual stages "
                         f"{virtual} need pp_schedule 'interleaved_1f1b'")
    if name == "interleaved_1f1b" and micro % stages:
        raise ValueError(f"interleaved_1f1b needs micro-batches divisible by the stages: {micro} micro-batches "
                         f"on {stages} stages; use a multiple of {stages} (gradient_accumulation_steps)")
    if layers is not None and layers % (stages * virtual):
        raise ValueError(f"the model's {layers} layers do not split into {stages} stages x {virtual} virtual "
                         f"stages = {stages * virtual} equal parts; choose pipeline_parallel_size and "
                         f"virtual stages whose product divides {layers}")


def build(name: str, stages: int, micro: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for ``stages`` devices, ``micro``
    micro-batches and ``virtual`` model chunks per device, sends and receives included."""
    check_sizes(name, stages, virtual, micro)
    orders = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved, "zb_h1": _zb_h1}[name](
        stages, micro, virtual)
    return Schedule(name, stages, virtual, micro, tuple(_with_comm(o, stages, virtual) for o in orders))


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    """Every forward, then every backward (GPipe): m micro-batches in flight."""
    return [[Action("F", d, j) for j in range(m)] + [Action("B", d, j) for j in range(m)] for d in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): p - d - 1 warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards: at most p - d micro-batches in flight on device d."""
    out = []
    for d in range(p):
        warm = min(p - d - 1, m)
        acts = [Action("F", d, j) for j in range(warm)]
        for j in range(m - warm):
            acts += [Action("F", d, warm + j), Action("B", d, j)]
        acts += [Action("B", d, j) for j in range(m - warm, m)]
        out.append(acts)
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM): micro-batches in groups of p run through chunk 0, then
    chunk 1, ...; backwards through the chunks in reverse; (p - d - 1) * 2 + (v - 1) * p warm-up
    forwards on device d."""
    total = m * v

    def chunk_micro(i: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(i, p * v)
        chunk = within // p
        return (v - 1 - chunk if backward else chunk), group * p + within % p

    out = []
    for d in range(p):
        def fwd(i):
            c, j = chunk_micro(i, False)
            return Action("F", c * p + d, j)

        def bwd(i):
            c, j = chunk_micro(i, True)
            return Action("B", c * p + d, j)
        warm = min((p - d - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(i) for i in range(warm)]
        for i in range(total - warm):
            acts += [fwd(warm + i), bwd(i)]
        acts += [bwd(i) for i in range(total - warm, total)]
        out.append(acts)
    return out


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    """ZB-H1 style (Qi et al., zero-bubble pipeline parallelism): the backward split into BI
    (sent on at once) and BW, which fills the slots where a device would wait. A unit-time list
    schedule: a ready BI first, then a forward within 1F1B's bound (p - d micro-batches whose
    BI is pending on device d), then the oldest deferred BW (at once when p are deferred). Its
    bubble is (p - 1) / (3m + p - 1) for m >= p; the inputs of at most p deferred weight
    gradients are held besides 1F1B's activations (docs/pipelines.md)."""
    done: dict[tuple[str, int, int], int] = {}      # (kind, stage, micro) -> end time
    nxt_f, nxt_b = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in out):
        ran = []
        for d in range(p):
            j = nxt_b[d]
            b_ready = j < nxt_f[d] and done.get(("F", d, j), t + 1) <= t and (
                d == p - 1 or done.get(("BI", d + 1, j), t + 1) <= t)
            f_ready = nxt_f[d] < m and (d == 0 or done.get(("F", d - 1, nxt_f[d]), t + 1) <= t)
            in_flight = nxt_f[d] - nxt_b[d]
            if len(pending_w[d]) >= p and not b_ready:      # at most p weight gradients deferred
                act = Action("BW", d, pending_w[d].pop(0))
            elif b_ready:
                act = Action("BI", d, j)
                nxt_b[d] += 1
                pending_w[d].append(j)
            elif f_ready and in_flight < p - d:
                act = Action("F", d, nxt_f[d])
                nxt_f[d] += 1
            elif pending_w[d]:
                act = Action("BW", d, pending_w[d].pop(0))
            else:
                continue
            out[d].append(act)
            ran.append(act)
        for a in ran:
            done[(a.kind, a.stage, a.micro)] = t + 1
        t += 1
    return out


def _with_comm(order: list[Action], p: int, v: int) -> tuple[Action, ...]:
    """``order`` with the receive before and the send after each compute action that crosses a
    device boundary (a virtual stage whose neighbour runs on another device)."""
    last = p * v - 1
    out: list[Action] = []
    for a in order:
        k, j = a.stage, a.micro
        if a.kind == "F" and k > 0 and (k - 1) % p != k % p:
            out.append(Action("RECV_F", k, j, (k - 1) % p))
        if a.kind in ("B", "BI") and k < last and (k + 1) % p != k % p:
            out.append(Action("RECV_B", k, j, (k + 1) % p))
        out.append(a)
        if a.kind == "F" and k < last and (k + 1) % p != k % p:
            out.append(Action("SEND_F", k, j, (k + 1) % p))
        if a.kind in ("B", "BI") and k > 0 and (k - 1) % p != k % p:
            out.append(Action("SEND_B", k, j, (k - 1) % p))
    return tuple(out)
