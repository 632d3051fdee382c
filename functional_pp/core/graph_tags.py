"""Names of the tags a node of a traced step carries in ``node.meta["custom"]``.

Ops and collectives set them while traced (``compile/recompute.py``, ``core/comm.py``); the
passes of ``compile/`` read them. They live here, below both, so the communication records
need not import the compiler."""

REGATHER = "fpp_regather"      # an FSDP weight's all-gather and the views/casts after it
REMAT = "fpp_remat"            # an activation of a remat region
SELECTIVE = "fpp_selective"    # in a remat region that keeps its matmuls and attention (compile/selective.py)
LEAF = "fpp_leaf"              # a parameter made differentiable as p + seed (torch 2.11's path)
RECOMPUTED = "fpp_recomputed"  # a node the backward recomputes
BACKWARD = "fpp_backward"      # set on everything torch.autograd.grad traces in a step
TRACED = "fpp_comm"            # a collective traced under torch.compile
