"""Pipeline layouts in the planner (docs/planning.md, "Pipelines"): a mesh with ``pp`` > 1 is
planned as one device of one stage running one micro-batch (the dry-run of its L / pp layers
on the mesh without ``pp``), and the schedule on top: its executed timeline
(:func:`functional_pp.parallel.pipeline.timing.simulate`) gives the step's length in
micro-batch slots and the activations each device holds; the stage-to-stage transfers are the
boundary's bytes on the link ``pp`` crosses."""
from __future__ import annotations

from dataclasses import dataclass

from functional_pp.core.layout import Rules
from functional_pp.core.mesh import Mesh
from functional_pp.parallel.pipeline.schedule import build, check_sizes
from functional_pp.parallel.pipeline.timing import Timeline, simulate

PP = "pp"


@dataclass(frozen=True)
class PipelinePlan:
    """The schedule of a pipeline layout and what it implies for one device."""
    schedule: str
    stages: int
    virtual: int
    micro: int
    layers_per_device: int
    timeline: Timeline
    boundary_bytes: int              # one activation (or its gradient) crossing a stage boundary
    sends: int                       # transfers the busiest device sends per step (both directions)
    in_flight: int                   # (virtual stage, micro-batch) activations the busiest device holds
    fsdp_gather: str = "step"        # FSDP units gathered once per step ("step") or per micro-batch ("micro")
    gather_scale: float = 1.0        # "step": bytes of its gathers (master dtype) over a micro-batch's (compute dtype)

    @property
    def bubble(self) -> float:
        """Idle slots over all slots of the executed timeline."""
        return self.timeline.bubble

    @property
    def slots_per_busy(self) -> float:
        """Step length over one device's own work (1 / (1 - bubble))."""
        s = self.timeline
        return s.makespan / max(s.busy(d) for d in range(self.stages))

    def row(self) -> dict:
        return {"schedule": self.schedule, "stages": self.stages, "virtual_stages": self.virtual,
                "micro_batches": self.micro, "bubble": self.bubble, "in_flight": self.in_flight,
                "boundary_bytes": self.boundary_bytes, "sends": self.sends, "fsdp_gather": self.fsdp_gather}


def split_pipeline(mesh: Mesh, rules: Rules, layers: int, micro: int, schedule: str,
                   virtual: int) -> tuple[Mesh, Rules, Timeline]:
    """The mesh and rules one stage runs on (``pp`` removed, the ``layers`` rule dropped) and the
    executed schedule; clear errors for rules that do not split the layers over ``pp``, sizes
    that do not divide, unknown schedules."""
    p = mesh.shape[PP]
    table = dict(getattr(rules, "table", {}))
    if tuple(table.get("layers", ())) != (PP,):
        raise ValueError(f"plan.estimate: the mesh has pp={p} but the rules do not split the layers over it; add "
                         f"the rule layers='pp' (Rules(..., layers='pp'))")
    others = [k for k, v in table.items() if k != "layers" and PP in tuple(v)] + \
        [k for k, (_, extra) in rules.derived.items() if PP in tuple(extra)]
    if others:
        raise ValueError(f"plan.estimate: the rules {others} name the pp axis; only layers='pp' may")
    check_sizes(schedule, p, virtual, micro, layers=layers)
    inner = Mesh.from_axes([(a, s) for a, s in mesh.shape.items() if a != PP])
    inner_rules = rules.replace(layers=None)
    return inner, inner_rules, simulate(build(schedule, p, micro, virtual))


def pipeline_plan(timeline: Timeline, layers: int, boundary_bytes: int, fsdp_gather: str = "step") -> PipelinePlan:
    """What the executed ``timeline`` implies for the busiest device."""
    s = timeline.schedule
    p = s.stages
    sends = [sum(a.kind.startswith("SEND") for a in s.actions[d]) for d in range(p)]
    held = [timeline.in_flight(d) for d in range(p)]
    return PipelinePlan(s.name, p, s.virtual, s.micro, layers // p, timeline, boundary_bytes, max(sends), max(held),
                        fsdp_gather)
