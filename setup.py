"""Builds the compiled core (src/csfq/*.pyx -> sfq._csfq).

If the extension cannot be built (no compiler), the install still succeeds and sfq uses
its pure-Python twin, saying so with a RuntimeWarning at import. Set
SFQ_REQUIRE_EXTENSIONS=1 to make a failed build an error instead (CI does).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRE = os.environ.get("SFQ_REQUIRE_EXTENSIONS", "") not in ("", "0")
NO_EXT = os.environ.get("SFQ_NO_EXTENSIONS", "") not in ("", "0") and not REQUIRE
LINUX = sys.platform.startswith("linux")


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    else:
        print(f"removed {path}: it was not built from these sources")


class optional_build_ext(build_ext):
    """Builds the core; a failed build leaves no extension behind.

    A reused tree keeps the previous build's ``.so`` in ``build/``, and setuptools copies
    whatever is there into the wheel: a failed compile would ship that stale module. So a
    failure removes the target (and, with ``--inplace``, the copy next to the sources).
    """

    def run(self):
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the machine
            for ext in self.extensions:
                _remove(self.get_ext_fullpath(ext.name))
            if REQUIRE:
                raise
            print(f"WARNING: sfq's compiled core was not built ({exc}); the pure-Python twin will be used")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            _remove(self.get_ext_fullpath(ext.name))
            if REQUIRE:
                raise
            print(f"WARNING: building {ext.name} failed ({exc}); the pure-Python twin will be used")


def extensions():
    if NO_EXT:
        return []
    from Cython.Build import cythonize

    ext = Extension(
        "sfq._csfq",
        ["src/csfq/_csfq.pyx"],
        include_dirs=["src/csfq"],
        depends=["src/csfq/sfq_heap.h"],
        # no debug info, stripped symbols: the wheel's .so is what users download and load
        extra_compile_args=["-O3", "-g0"] if os.name != "nt" else [],
        extra_link_args=["-s"] if LINUX else [],
    )
    return cythonize(
        [ext],
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "embedsignature": True,
        },
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": optional_build_ext})
