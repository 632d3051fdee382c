"""FSDP: parameters sharded over the data-parallel mesh axes, all-gathered where they are used
and their gradients reduce-scattered (docs/communication.md, "FSDP units"; docs/layouts.md).

Three ways to gather, each with its eager form and its compiled (traced) form side by side:

* per weight, ZeRO-3 (``regather.py``): an op that needs a sharded weight gathers it (the ops'
  ``relayout``); the gathered weight keeps its shard and is gathered again in backward instead
  of being saved. Compiled: the gather is tagged (``graph.regather_region``) and compile's
  recomputation pass re-issues it in backward (functional_pp/compile/recompute.py);
* per layer (``units.py``): the weights of one ``fpp.layer`` call gathered with one flat
  all-gather per group of mesh axes and their gradients reduce-scattered with one flat
  reduce-scatter; the next unit prefetched in the order of the last forward (``order.py``), at
  most the policy's ``collectives_in_flight`` reduce-scatters in flight. Compiled: the same
  flat collectives traced, tagged for the re-gather; prefetch, late waits and the in-flight
  bound are the graph pass of ``graph.py``;
* once per step under a pipeline (``gather_once.py``, ``fsdp_gather="step"``): a device's
  stages keep their units gathered across every micro-batch and reduce-scatter once.

``param_uses.py`` counts the gathers of each parameter in one model pass of a step's first
forward, so that a parameter gathered at several sites is gathered once from the next forward
on (tied); a loss that runs the model twice (DPO) does not make every parameter tied.
"""
