"""Layouts as data: estimate a layout's communication, memory and step time without running
it, and search the layouts of a cluster for the best ones (docs/planning.md).

- :func:`estimate`: one representative device runs the training step on meta tensors.
- :class:`Cluster`, :func:`cost`: the time model (alpha-beta on the links each axis crosses).
- :func:`search`: meshes x orders x rule sets, pruned, ranked, Pareto front.
- :func:`estimate_generation`: the memory of a generation (weights, key / value cache, one
  forward) on one representative device.
- :func:`trace`: every collective, saved tensor and the memory timeline of a dry-run."""
from functional_pp.plan.cluster import PRESETS, Cluster, cluster
from functional_pp.plan.dryrun import LayoutEstimate, estimate, extrapolate
from functional_pp.plan.generation import GenerationEstimate, estimate_generation
from functional_pp.plan.search import (Candidate, Ranking, Space, beam, candidates, exhaustive, factorizations, search,
                                       standard_rules, table)
from functional_pp.plan.timing import StepTime, cost, fit_cluster
from functional_pp.plan.trace import trace, write_trace
from functional_pp.plan.tracker import CATEGORIES, DeviceRun, SavedTensor, TaggedEvent, count_saved

__all__ = ["estimate", "extrapolate", "LayoutEstimate", "estimate_generation", "GenerationEstimate", "DeviceRun", "SavedTensor", "TaggedEvent", "CATEGORIES",
           "count_saved", "Cluster", "cluster", "PRESETS", "StepTime", "cost", "fit_cluster", "search", "Space",
           "Candidate", "Ranking", "candidates", "exhaustive", "beam", "factorizations", "standard_rules", "table", "trace", "write_trace"]
