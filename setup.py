"""Builds the compiled core (src/csfq/*.pyx -> sfq._csfq) and the compiled request engine.

The engine's modules (sfq._compiled.MODULES: the engine, its pool, the policy's limits and
retries, the backends' health, a permit and a dispatcher's statistics) are compiled by mypyc
from their own source, which stays their twin; the build records each source's SHA-256 in
sfq/_mypyc.json, so that an edited source never runs a stale build (sfq/_compiled.py).

Where the engine is compiled (as mypy and black do it: in what users install, opt-in elsewhere):

* in a wheel: ``pip install .``, ``pip wheel .``, ``python -m build``, cibuildwheel;
* not in an editable install (``pip install -e .``) nor ``setup.py build_ext --inplace``: the
  engine runs from its source there, so an edit runs at once and a rebuild costs no mypyc
  (about 8 s of mypy and 45 s of C on a 2-core machine);
* ``SFQ_MYPYC=1`` compiles it in every build (an editable install too), ``SFQ_MYPYC=0`` in none;
  ``SFQ_REQUIRE_EXTENSIONS=1`` compiles it too, unless ``SFQ_MYPYC=0``.

The Cython core is compiled in every build (a few seconds).

If either cannot be built (no compiler, no mypy), the install still succeeds and sfq runs the
pure-Python twin of what is missing (the core says so with a RuntimeWarning at import). Set
SFQ_REQUIRE_EXTENSIONS=1 to make a failed build an error instead (CI does).
"""

import ast
import hashlib
import json
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRE = os.environ.get("SFQ_REQUIRE_EXTENSIONS", "") not in ("", "0")
NO_EXT = os.environ.get("SFQ_NO_EXTENSIONS", "") not in ("", "0") and not REQUIRE
LINUX = sys.platform.startswith("linux")
MYPYC = os.environ.get("SFQ_MYPYC", "")  # "1": compile the engine in every build; "0": in none


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    else:
        print(f"removed {path}: it was not built from these sources")


def _engine_modules():
    """sfq._compiled.MODULES, read without importing sfq (its dependencies may be missing)."""
    tree = ast.parse(open(os.path.join("python", "sfq", "_compiled.py"), encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["MODULES"]:
            return list(ast.literal_eval(node.value))
    raise RuntimeError("python/sfq/_compiled.py has no MODULES")


ENGINE_MODULES = _engine_modules()
ENGINE_GROUP = "sfq__mypyc"  # the library the compiled modules share (mypyc's group)
RECORD = "_mypyc.json"  # sfq._compiled.RECORD


def _source(name):
    return os.path.join("python", *name.split(".")) + ".py"


class optional_build_ext(build_ext):
    """Builds the core and the engine; a failed build leaves no extension behind.

    A reused tree keeps the previous build's ``.so`` in ``build/``, and setuptools copies
    whatever is there into the wheel: a failed compile would ship that stale module. So a
    failure removes the target (and, with ``--inplace``, the copy next to the sources). The
    engine's modules go together (they share one library): if one fails, none is kept, and the
    build record that lets them run is written only when all were built.
    """

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:  # the core and the engine's library side by side
            self.parallel = os.cpu_count() or 1

    def _engine_exts(self):
        return [e for e in self.extensions if e.name in ENGINE_MODULES or e.name.startswith(ENGINE_GROUP)]

    def _record_path(self):
        return os.path.join(os.path.dirname(self.get_ext_fullpath("sfq._csfq")), RECORD)

    def _drop_engine(self, why):
        for ext in self._engine_exts():
            _remove(self.get_ext_fullpath(ext.name))
        _remove(self._record_path())
        if REQUIRE:
            raise RuntimeError(f"sfq's request engine was not compiled: {why}")
        print(f"WARNING: sfq's request engine was not compiled ({why}); it will run from its source")

    def run(self):
        self._failed = set()
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the machine
            for ext in self.extensions:
                _remove(self.get_ext_fullpath(ext.name))
            _remove(self._record_path())
            if REQUIRE:
                raise
            print(f"WARNING: sfq's compiled core was not built ({exc}); the pure-Python twin will be used")
            return
        engine = self._engine_exts()
        if not engine:  # not compiled this time: an earlier build's modules and record must not ship or run
            for name in (*ENGINE_MODULES, ENGINE_GROUP):
                _remove(self.get_ext_fullpath(name))
            _remove(self._record_path())
        elif self._failed & {e.name for e in engine}:
            self._drop_engine("a compile failed")
        else:
            from mypy.version import __version__ as mypy_version  # (mypyc built them, so it is there)

            record = {"mypy": mypy_version, "modules": {}}
            for name in ENGINE_MODULES:
                with open(_source(name), "rb") as f:
                    record["modules"][name] = hashlib.sha256(f.read()).hexdigest()
            os.makedirs(os.path.dirname(self._record_path()), exist_ok=True)
            with open(self._record_path(), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1, sort_keys=True)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            _remove(self.get_ext_fullpath(ext.name))
            self._failed.add(ext.name)
            if REQUIRE:
                raise
            what = "the pure-Python twin" if ext.name == "sfq._csfq" else "its source"
            print(f"WARNING: building {ext.name} failed ({exc}); {what} will be used")


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


#: the commands that build extensions; the others (egg_info, dist_info, sdist: pip runs setup.py
#: for the metadata first) need no generated C, and mypyc's type analysis takes seconds
BUILDS = {"build", "build_ext", "bdist_wheel", "bdist", "install", "develop", "editable_wheel"}
#: the builds of what users install (pip install . and python -m build run bdist_wheel)
RELEASE_BUILDS = {"build", "bdist_wheel", "bdist", "install"}
#: an editable install or an in-place build: a contributor's tree, the engine left as source
IN_PLACE = {"develop", "editable_wheel", "--inplace", "-i"}


def compile_engine(argv):
    """Whether this build compiles the engine with mypyc (the module's docstring says when)."""
    if NO_EXT or MYPYC == "0" or not BUILDS.intersection(argv):
        return False
    if MYPYC not in ("", "0"):
        return True
    return REQUIRE or (bool(RELEASE_BUILDS.intersection(argv)) and not IN_PLACE.intersection(argv))


def engine_extensions():
    """The engine's modules compiled by mypyc (generated C in build/mypyc; needs mypy)."""
    if not compile_engine(sys.argv[1:]):
        if BUILDS.intersection(sys.argv[1:]) and not NO_EXT:
            print("sfq's request engine runs from its source in this build (SFQ_MYPYC=1 compiles it)")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        if REQUIRE:
            raise
        print(f"WARNING: sfq's request engine was not compiled (mypyc is not installed: {exc}); it will run from its source")
        return []
    try:
        exts = mypycify(
            # mypy reads the compiled modules' types only, not the whole package's (8 s, not 50):
            # what they import from elsewhere is Any to mypyc, as it is to Python
            # (and the build's own environment has none of sfq's dependencies: those are Any too)
            ["--follow-imports=skip", "--ignore-missing-imports", *map(_source, ENGINE_MODULES)],
            opt_level="3",
            debug_level="0",  # as the core: no debug info in what users download
            group_name=ENGINE_GROUP.removesuffix("__mypyc"),
            target_dir=os.path.join("build", "mypyc"),
        )
    except (Exception, SystemExit) as exc:  # mypy reports type errors by exiting
        if REQUIRE:
            raise
        print(f"WARNING: sfq's request engine was not compiled (mypyc stopped: {exc!r}); it will run from its source")
        return []
    for ext in exts:
        if LINUX:
            ext.extra_link_args = [*ext.extra_link_args, "-s"]
    return exts


setup(ext_modules=extensions() + engine_extensions(), cmdclass={"build_ext": optional_build_ext})
