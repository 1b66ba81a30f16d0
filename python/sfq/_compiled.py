"""The request engine's modules compiled by mypyc, and the switch back to their source.

The engine (``sfq.engine``'s pool and engine, the policy's limits and retries, the backends'
health; and what every permit of the asyncio driver runs through: ``acquire``'s ``Permit``
and a ``Dispatcher``'s per-flow statistics) is plain, annotated Python. ``setup.py`` also
compiles those modules with mypyc (https://mypyc.readthedocs.io): the same source as C, its
classes native, a few times faster on the dispatch path. The ``.py`` files stay the twin, as
``_scheduler_py.py`` is the core's: one implementation, run two ways, and the suite runs on
both (CI's ``SFQ_NO_EXTENSIONS=1`` leg).

The build compiles them where users run them: a wheel, ``pip install .``. An editable install
(``pip install -e .``) leaves them as source, so an edit runs at once; ``SFQ_MYPYC=1`` compiles
them there too (``setup.py`` says when, and docs/development.md).

A compiled module (``pool.cpython-311-x86_64-linux-gnu.so``) sits next to its ``.py`` and
Python's import system prefers it. This module's finder, first on ``sys.meta_path`` once sfq
is imported, hands out the source instead when

* ``SFQ_NO_EXTENSIONS=1`` is set (as for the core);
* the build left no record (``_mypyc.json``: the SHA-256 of each source it compiled), or a
  compiled module is missing: an editable install, unless ``SFQ_MYPYC=1`` compiled it;
* a source no longer matches its record: an edited file in an editable install built with
  ``SFQ_MYPYC=1``, whose stale build would otherwise run silently. One ``RuntimeWarning``
  names the file and how to rebuild.

The modules share one compiled library (mypyc's ``sfq__mypyc``), and their native classes
call each other directly, so it is all or nothing: if one module must run from source, they
all do. The decision is made once, on the first import of one of them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MODULES", "RECORD", "engine_status", "install"]

#: the modules setup.py compiles with mypyc (it reads this tuple; keep it a literal)
MODULES = (
    "sfq.engine.pool",
    "sfq.engine.engine",
    "sfq.policy.limits",
    "sfq.policy.retry",
    "sfq.backends.health",
    "sfq.dispatch.tally",  # a Dispatcher's per-flow statistics: the engine calls them for every request
    "sfq.dispatch.permit",  # acquire()'s Permit: every permit enters and leaves through it
)
#: the build's record, next to this file: {"mypy": the version that compiled them, "modules": {name: sha256 of the .py}}
RECORD = "_mypyc.json"

_HERE = os.path.dirname(os.path.abspath(__file__))
_status: str | None = None  # "compiled", or "source: <why>"; decided on first use


def _source_of(name: str) -> str:
    return os.path.join(_HERE, *name.split(".")[1:]) + ".py"


def _decide() -> str:
    import hashlib  # (here: `import sfq` alone never decides, and stays light)
    import json

    if os.environ.get("SFQ_NO_EXTENSIONS", "") not in ("", "0"):
        return "source: SFQ_NO_EXTENSIONS=1"
    try:
        with open(os.path.join(_HERE, RECORD), encoding="utf-8") as f:
            record = json.load(f)
        digests = record["modules"]
    except FileNotFoundError:
        return "source: not compiled (no build record: an editable install, unless built with SFQ_MYPYC=1)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"source: unreadable build record {RECORD} ({exc})"
    if not isinstance(digests, dict) or set(digests) != set(MODULES):
        return f"source: the build record {RECORD} lists other modules"
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for name in MODULES:
        source = _source_of(name)
        stem = source[: -len(".py")]
        if not any(os.path.isfile(stem + s) for s in suffixes):
            return f"source: {name} has no compiled module"
        try:
            with open(source, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            continue  # shipped without its source: the compiled module is all there is
        if digest != digests[name]:
            warnings.warn(
                f"sfq: {source} has changed since it was compiled; the request engine runs from its "
                "source (rebuild to compile it again: SFQ_MYPYC=1 pip install -e ., or SFQ_MYPYC=1 python setup.py "
                "build_ext --inplace)",
                RuntimeWarning,
                stacklevel=4,
            )
            return f"source: {source} changed since it was compiled"
    return "compiled"


def engine_status() -> str:
    """``"compiled"`` when the engine's modules run compiled, else ``"source: <why>"``."""
    global _status
    if _status is None:
        _status = _decide()
    return _status


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Hands out a compiled module's ``.py`` when the engine must run from source."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES or engine_status() == "compiled":
            return None  # the usual finders: the compiled module, or the source where none is
        source = _source_of(fullname)
        if not os.path.isfile(source):
            return None  # shipped without its source: the compiled module is all there is
        return importlib.util.spec_from_file_location(fullname, source)


_FINDER = _SourceFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; ``import sfq`` does it)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
