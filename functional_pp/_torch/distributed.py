"""Functional collectives (``torch.distributed._functional_collectives``): the traceable
collectives the process backend issues, so ``torch.compile`` sees them as graph nodes."""
import torch.distributed._functional_collectives as funcol

__all__ = ["funcol"]
