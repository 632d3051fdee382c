"""Devices: ``launch`` on real processes (gloo, NCCL) or on a simulated mesh (threaded or
batched), and the communication backends under them: raw (non-differentiable) collectives
over groups of ranks.

A group is a tuple of global ranks ordered by group index. Every backend offers
``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` and ``permute`` with the
same semantics; autodiff and byte counting live above them in ``functional_pp.parallel.collectives``.
"""
from functional_pp.devices.sim import SimAborted, SimBackend, SimWorld

__all__ = ["SimBackend", "SimWorld", "SimAborted"]
