"""The public surface: everything in __all__ resolves, and the core imports no aiohttp."""

from __future__ import annotations

import subprocess
import sys

import sfq


def test_all_names_resolve():
    for name in sfq.__all__:
        assert getattr(sfq, name) is not None, name
    assert issubclass(sfq.BackendError, sfq.SFQError)


def test_core_import_is_light():
    code = "import sys, sfq; s = sfq.Scheduler(); s.enqueue('a', 1); print('aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_py_typed_shipped():
    import importlib.resources

    assert importlib.resources.files("sfq").joinpath("py.typed").is_file()
