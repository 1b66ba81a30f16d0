"""Imports of optional dependencies, failing with the extra that provides them.

The base install (``pip install sfq-scheduler``) is what an embedder needs: the core, the
estimator, the dispatcher and its backends. ``sfq simulate``'s tables and plots need the
``sim`` extra (rich, matplotlib). A missing one raises :class:`MissingExtra`, an
``ImportError`` whose message names the package and the command that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtra", "require"]


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra provides it."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        self.module = module
        self.extra = extra
        package = module.split(".")[0]
        super().__init__(
            f"{purpose} needs {package!r}, which is not installed: "
            f"pip install 'sfq-scheduler[{extra}]'",
            name=package,
        )


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``; if it (or a package it needs) is missing, raise :class:`MissingExtra`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(module, extra, purpose) from exc
