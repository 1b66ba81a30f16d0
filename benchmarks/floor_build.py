"""Build and import the C-loop floor (``cfloor.pyx``) for the benchmarks.

``load_cfloor()`` compiles ``benchmarks/cfloor.pyx`` with Cython and the C compiler into
``benchmarks/build/`` (git-ignored; nothing generated is committed), unless the built module
there is newer than the source, and imports it. The compiled core's flags are used (``-O3``).
A failed build raises: the floor is part of the benchmark, not optional.

``python benchmarks/floor_build.py`` builds it alone and prints where it went.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "cfloor.pyx"
BUILD_DIR = HERE / "build"


def _built() -> Path | None:
    """The built module in BUILD_DIR if it is newer than the source, else None."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for p in BUILD_DIR.glob("cfloor*"):
        if any(p.name == "cfloor" + s for s in suffixes) and p.stat().st_mtime >= SOURCE.stat().st_mtime:
            return p
    return None


def build(force: bool = False) -> Path:
    """Compile cfloor.pyx into BUILD_DIR (if stale or forced); returns the module's path."""
    if not force:
        done = _built()
        if done is not None:
            return done
    try:
        # setuptools first: it puts its vendored packages on the path, which its distutils needs
        from setuptools import Distribution, Extension
        from Cython.Build import cythonize
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            f"building the C floor needs Cython and setuptools ({exc}); pip install 'Cython>=3.0.8' setuptools"
        ) from exc
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    ext = Extension("cfloor", [str(SOURCE)], extra_compile_args=["-O3"])
    modules = cythonize(  # type: ignore[no-untyped-call]
        [ext], build_dir=str(BUILD_DIR / "c"), quiet=True, force=force, compiler_directives={"language_level": 3}
    )
    dist = Distribution({"name": "cfloor", "ext_modules": modules})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(BUILD_DIR)
    cmd.build_temp = str(BUILD_DIR / "tmp")
    cmd.force = True  # stale or forced: decided above
    cmd.ensure_finalized()
    cmd.run()
    done = _built()
    if done is None:
        raise RuntimeError(f"building {SOURCE} produced no module in {BUILD_DIR}")
    return done


def load_cfloor(force: bool = False) -> ModuleType:
    """Build (if needed) and import the floor module."""
    path = build(force)
    spec = importlib.util.spec_from_file_location("cfloor", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot import {path}")
    if "cfloor" in sys.modules and getattr(sys.modules["cfloor"], "__file__", None) == str(path):
        return sys.modules["cfloor"]
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cfloor"] = mod
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    print(build(force="--force" in sys.argv[1:]))
