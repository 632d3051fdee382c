"""Layouts as data: estimate a layout's communication, memory and step time without running
it, and search the layouts of a cluster for the best ones (docs/planning.md).

- :func:`estimate`: one representative device runs the training step on meta tensors.
- :class:`Cluster`, :func:`cost`: the time model (alpha-beta on the links each axis crosses).
- :func:`search`: meshes x orders x rule sets, pruned, ranked, Pareto front.
- :func:`trace`: every collective, saved tensor and the memory timeline of a dry-run."""
from .dryrun import LayoutEstimate, estimate, extrapolate
from .tracker import CATEGORIES, count_saved, DeviceRun, SavedTensor, TaggedEvent

__all__ = ["estimate", "extrapolate", "LayoutEstimate", "DeviceRun", "SavedTensor", "TaggedEvent", "CATEGORIES", "count_saved"]
