"""What a request is charged: the three charge modes, defined once.

* ``served`` (the default): a stream is charged its prompt at dispatch and its output tokens as
  they are delivered; a plain request its estimate at dispatch; both are reconciled with the
  server's ``usage`` at completion (VTC's idea, Sheng et al., OSDI 2024, applied at the balancer).
* ``settle``: the estimate at dispatch, corrected to the ``usage`` at completion.
* ``seed``: the estimate at dispatch, never corrected (the plain SFQ rule of Goyal, Vin and
  Cheng, 1996; docs/design.md §2).
"""

from __future__ import annotations

import enum

__all__ = ["CHARGE_MODES", "DEFAULT_CHARGE", "ChargeMode"]


class ChargeMode(str, enum.Enum):
    """A charge mode; compares equal to its name (``ChargeMode.SERVED == "served"``)."""

    SERVED = "served"
    SETTLE = "settle"
    SEED = "seed"

    def __str__(self) -> str:
        return self.value


#: the modes' names, the default first
CHARGE_MODES: tuple[str, ...] = tuple(m.value for m in ChargeMode)
#: the library's default, chosen by measurement (docs/simulator.md)
DEFAULT_CHARGE = ChargeMode.SERVED.value
