"""Seeds: one check shared by parameter init, the data loader and the command line."""
from __future__ import annotations

SEED_MAX = 2 ** 63 - 1


def check_seed(seed: object, where: str = "seed") -> int:
    """``seed`` as an int if it is an integer in ``0..2**63-1`` (numpy's generators and the
    counter-based init need one); otherwise a ValueError saying what to pass."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{where} must be an integer in 0..2**63-1, got {seed!r}; pick any "
                         f"non-negative number (e.g. 0)")
    return int(seed)
