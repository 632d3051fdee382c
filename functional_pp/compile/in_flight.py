"""How many asynchronous collectives of one kind a step may have launched and not yet awaited.

One setting, ``FPP_COLLECTIVES_IN_FLIGHT`` (default 2; 0: no bound), bounds them in eager
and compiled steps alike (docs/communication.md, "Collectives in flight"). An asynchronous
collective holds its full-size input until it is awaited, so the bound is what keeps
unsharded gradients from piling up until the optimizer:

* compiled graphs (``overlap.bound_in_flight``): the wait of the k-th collective of a kind
  moves before the launch of the (k+N)-th;
* eager FSDP units (``fsdp_units``): a gradient reduce-scatter is launched when backward
  produces the unit's gradients, and once N are outstanding the oldest is awaited at once
  (eager code cannot see when the next launch will come).
"""
from __future__ import annotations

import os

IN_FLIGHT_ENV = "FPP_COLLECTIVES_IN_FLIGHT"
DEFAULT_IN_FLIGHT = 2


def in_flight_limit() -> int:
    """The bound on collectives of one kind in flight (``FPP_COLLECTIVES_IN_FLIGHT``; 0: no
    bound); a value that is not a whole number >= 0 raises, naming the variable."""
    raw = os.environ.get(IN_FLIGHT_ENV, str(DEFAULT_IN_FLIGHT))
    try:
        limit = int(raw)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{IN_FLIGHT_ENV}={raw!r}: expected a whole number of collectives of one kind in "
                         f"flight at once (>= 1), or 0 for no bound; the default is {DEFAULT_IN_FLIGHT}")
    return limit
