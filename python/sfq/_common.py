"""Facts both scheduler twins share: the fixed-point scale, the limits, argument checks.

One place per fact: the compiled core imports these checks for every slow path, so the
two twins raise the same exceptions with the same messages.

Units
-----
A *cost unit* is whatever the caller's costs are in (tokens, weighted tokens, ...).
Meters are kept as integers in *sub-units*: ``SCALE`` sub-units make one cost unit.
A charge is ``ceil(cost * SCALE / weight)`` sub-units, computed in IEEE double
arithmetic (identical in C and Python), so integer costs with power-of-two weights are
exact, and every charge is at least one sub-unit (a finish tag is always > its start).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, NamedTuple

#: sub-units per cost unit (2**20: about one millionth of a cost unit)
SCALE = 1 << 20
#: largest accepted cost, in cost units (2**30, about 1.07e9)
MAX_COST = float(1 << 30)
#: smallest and largest accepted weight
MIN_WEIGHT = 2.0**-10
MAX_WEIGHT = 2.0**20
#: largest single charge in sub-units: MAX_COST * SCALE / MIN_WEIGHT = 2**60
MAX_CHARGE = 1 << 60
#: the compiled core subtracts v from every meter once v reaches this many sub-units
#: (2**61); meters then stay below v + MAX_CHARGE < 2**62, far from int64's 2**63
RENORM_AT = 1 << 61
#: default weight of a flow
DEFAULT_WEIGHT = 1.0
#: how far ``adjust()`` may move a meter ahead of v, in sub-units (2**61): with charges of at
#: most MAX_CHARGE and renormalisation at RENORM_AT, every value then stays below 2**63
MAX_LEAD = 1 << 61

#: what a scheduler method says when it is called while another of its methods is running
REENTRANT = (
    "re-entrant call: a method of this scheduler is already running in this thread (the call came "
    "from Python code that the scheduler ran, such as a flow id's __hash__ or __eq__, a cost's "
    "__float__ or a payload's __del__); it was refused and the scheduler is unchanged"
)
CONCURRENT = (
    "concurrent call: a method of this scheduler is running in another thread; a scheduler must "
    "be used from one thread at a time (guard it with a lock); the call was refused"
)


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r} of type {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise OverflowError(f"{what} {value!r} is too large to represent") from None


def check_cost(cost: object) -> float:
    """Return ``cost`` as a float, or raise naming the bad value."""
    if type(cost) is float and 0.0 < cost <= MAX_COST:  # the common case, in one test (NaN, inf fail it)
        return cost
    c = _number(cost, "cost")
    if not (c > 0.0) or math.isinf(c):
        raise ValueError(f"cost must be a finite number > 0, got {cost!r}")
    if c > MAX_COST:
        raise OverflowError(
            f"cost {cost!r} is too large: the largest cost whose charge can be represented is {MAX_COST:.0f}"
        )
    return c


def check_weight(weight: object) -> float:
    """Return ``weight`` as a float, or raise naming the bad value."""
    w = _number(weight, "weight")
    if not (w > 0.0) or math.isinf(w):
        raise ValueError(f"weight must be a finite number > 0, got {weight!r}")
    if w < MIN_WEIGHT or w > MAX_WEIGHT:
        raise ValueError(f"weight {weight!r} is outside the supported range [{MIN_WEIGHT!r}, {MAX_WEIGHT!r}]")
    return w


def check_count(n: object) -> int:
    """``dispatch_many``'s count as an int >= 0, or raise naming the bad value."""
    try:
        k = operator.index(n)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"n must be an integer, got {n!r} of type {type(n).__name__}") from None
    if k < 0:
        raise ValueError(f"n must be >= 0, got {n!r}")
    return int(k)


def check_delta(delta: object) -> float:
    """``adjust``'s correction as a float (either sign), or raise naming the bad value."""
    d = _number(delta, "delta")
    if math.isnan(d) or math.isinf(d):
        raise ValueError(f"delta must be a finite number, got {delta!r}")
    if abs(d) > MAX_COST:
        raise OverflowError(f"delta {delta!r} is too large: at most {MAX_COST:.0f} in either direction")
    return d


def adjustment(delta: float, weight: float) -> int:
    """Sub-units that ``adjust(flow, delta)`` adds to a meter: ``delta / weight``, rounded away
    from zero (so a correction is never lost to rounding, exactly like a charge)."""
    if delta >= 0.0:
        return math.ceil(delta * 1048576.0 / weight)
    return -math.ceil(-delta * 1048576.0 / weight)


def lead_overflow(flow: object, delta: object) -> OverflowError:
    return OverflowError(
        f"adjust({flow!r}, {delta!r}) would put the flow's meter more than {MAX_LEAD // SCALE} cost units ahead of v"
    )


def unhashable_flow(flow: object) -> TypeError:
    return TypeError(f"flow id {flow!r} is not hashable")


def check_flow(flow: object) -> None:
    try:
        hash(flow)
    except TypeError:
        raise unhashable_flow(flow) from None


def charge(cost: float, weight: float) -> int:
    """Sub-units charged for ``cost`` at ``weight`` (both already checked)."""
    return math.ceil(cost * 1048576.0 / weight)


def to_units(subunits: int) -> float:
    """Sub-units (an exact int) to cost units, correctly rounded."""
    return subunits / SCALE


class DispatchBatch(NamedTuple):
    """What ``dispatch_many(n)`` returns: parallel sequences, one entry per dispatch, in order.

    ``flows`` and ``items`` are lists; ``tickets`` (int64), ``costs``, ``starts`` and
    ``finishes`` (float64, cost units) are numpy arrays.
    """

    flows: list[Any]
    items: list[Any]
    tickets: Any
    costs: Any
    starts: Any
    finishes: Any

    def __len__(self) -> int:  # the number of dispatches, not of fields
        return len(self.flows)


def check_batch(
    flows: Any, costs: Any, items: Any, check_flows: bool = True
) -> tuple[list[Any], Any, list[Any] | None]:
    """Validate ``enqueue_many``'s arguments as a whole, before anything is enqueued.

    Returns ``(flows as a list, costs as a float64 array, items as a list or None)``.
    """
    import numpy as np

    if hasattr(flows, "tolist"):
        flows = flows.tolist()  # numpy arrays: plain Python ints/strs as flow ids
    flows = list(flows)
    n = len(flows)
    arr = np.asarray(costs)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"costs must be a 1-d sequence of {n} numbers (one per flow), got shape {arr.shape}")
    if arr.dtype.kind not in "fiu":
        # objects (Fraction, Decimal, ...): each checked exactly as enqueue() checks it
        arr = np.array([check_cost(c) for c in arr.tolist()], dtype=np.float64)
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    bad = ~((arr > 0.0) & (arr <= MAX_COST))  # NaN fails both comparisons
    if bad.any():
        check_cost(arr[int(np.argmax(bad))].item())  # raises, naming the first bad cost
    if items is not None:
        items = list(items)
        if len(items) != n:
            raise ValueError(f"items must have one entry per flow ({n}), got {len(items)}")
    if check_flows:  # the compiled core hashes them itself, in C
        for f in flows:
            check_flow(f)
    return flows, arr, items
