"""Selects the scheduler core: the compiled extension, or the pure-Python twin.

``SFQ_NO_EXTENSIONS=1`` forces the twin. If the extension is missing (a failed build),
the twin is used and one ``RuntimeWarning`` says so. Type checkers see the compiled
core's surface (``_csfq.pyi``), which the twin shares. Either way ``sfq.Dispatch`` is a class
called ``Dispatch``. With the compiled core, the twin (``sfq.ReferenceScheduler``) is imported
only when first asked for.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

NO_EXTENSIONS = os.environ.get("SFQ_NO_EXTENSIONS", "") not in ("", "0")
CORE: str

if TYPE_CHECKING:
    from ._csfq import Dispatch, Scheduler
elif NO_EXTENSIONS:
    from ._scheduler_py import Dispatch
    from ._scheduler_py import ReferenceScheduler as Scheduler

    CORE = "reference"
else:
    try:
        from ._csfq import Dispatch, Scheduler
    except ImportError as exc:  # pragma: no cover - depends on the build
        warnings.warn(
            f"sfq: the compiled core is not available ({exc}); using the pure-Python reference scheduler",
            RuntimeWarning,
            stacklevel=2,
        )
        from ._scheduler_py import Dispatch
        from ._scheduler_py import ReferenceScheduler as Scheduler

        CORE = "reference"
    else:
        CORE = "compiled"

__all__ = ["CORE", "Dispatch", "Scheduler"]
