"""The public surface: everything in __all__ resolves, ``import sfq`` is light, optional
dependencies name their extra, and the package ships its type information."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

import sfq

# what a plain ``import sfq`` must not load: numpy (the batch API imports it on first use),
# the dispatcher's, the policy file's and the simulator's libraries
HEAVY = ("numpy", "aiohttp", "yaml", "matplotlib", "rich", "prometheus_client", "starlette", "fastapi")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


def test_all_names_resolve():
    for name in sfq.__all__:
        assert getattr(sfq, name) is not None, name
    assert issubclass(sfq.BackendError, sfq.SFQError)
    assert len(set(sfq.__all__)) == len(sfq.__all__)


def test_all_is_the_public_face():
    """httpx's rule: ``__all__`` is exactly the module's public names (submodules aside), so
    nothing is public by accident and nothing public is missing from it."""
    for name in sfq.__all__:
        getattr(sfq, name)  # the lazy names too
    public = {n for n, v in vars(sfq).items()
              if (not n.startswith("_") or n == "__version__") and not isinstance(v, types.ModuleType)}
    assert public == set(sfq.__all__)
    assert sorted(dir(sfq)) == sorted(sfq.__all__)


def test_the_contract_names_are_public():
    for name in ("Scheduler", "ReferenceScheduler", "CORE", "Dispatch", "CostEstimator", "OpenAIBackend",
                 "Dispatcher", "PolicyDispatcher", "Flow", "Grant", "EventStream", "SFQError", "Refused", "load_policy",
                 "parse_policy"):
        assert name in sfq.__all__, name
    assert issubclass(sfq.errors.BadRequest, sfq.Refused) and issubclass(sfq.errors.BadRequest, ValueError)


@pytest.mark.parametrize("name, home", sorted(sfq._MOVED.items()))
def test_a_moved_name_still_resolves_with_a_warning(name, home):
    import importlib

    with pytest.warns(DeprecationWarning, match=f"sfq.{name} is {home}.{name}"):
        value = getattr(sfq, name)
    assert value is getattr(importlib.import_module(home), name)
    assert name not in vars(sfq) and name not in sfq.__all__


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Dispatchr'"):
        sfq.Dispatchr  # noqa: B018


@pytest.mark.parametrize("no_ext", ["0", "1"])
def test_core_import_is_light(no_ext):
    code = (
        "import sys, sfq\n"
        "s = sfq.Scheduler(); s.enqueue('a', 1); s.dispatch()\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = _python(code, SFQ_NO_EXTENSIONS=no_ext)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("no_ext", ["0", "1"])
def test_numpy_is_imported_by_the_batch_api_only(no_ext):
    code = (
        "import sys, sfq\n"
        "s = sfq.Scheduler(); s.enqueue('a', 1); s.dispatch()\n"
        "print('numpy' in sys.modules)\n"
        "s.enqueue_many(['a', 'b'], [1.0, 2.0]); print('numpy' in sys.modules)\n"
    )
    out = _python(code, SFQ_NO_EXTENSIONS=no_ext)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(
    "blocked, argv",
    [
        ("rich", ["simulate", "teams", "--steps", "50", "--no-plots"]),
        ("matplotlib", ["simulate", "teams", "--steps", "50"]),
    ],
)
def test_missing_sim_extra_names_it(blocked, argv):
    code = (
        "import sys\n"
        f"sys.modules[{blocked!r}] = None  # as if not installed\n"
        "from sfq.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    out = _python(code)
    assert out.returncode == 2
    assert f"needs {blocked!r}" in out.stderr
    assert "pip install 'sfq-scheduler[sim]'" in out.stderr
    assert out.stdout == ""


def test_sfq_top_without_rich_names_its_extra():
    code = (
        "import sys\n"
        "sys.modules['rich'] = None  # as if not installed\n"
        "from sfq.cli import main\n"
        "sys.exit(main(['top', '--once', '--url', 'http://127.0.0.1:9']))\n"
    )
    out = _python(code)
    assert out.returncode == 2
    assert "sfq top needs 'rich'" in out.stderr and "pip install 'sfq-scheduler[top]'" in out.stderr
    assert out.stdout == ""


def test_missing_extra_in_the_library_is_an_import_error():
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from sfq._optional import MissingExtra\n"
        "from sfq.sim.plots import _figure\n"
        "try:\n"
        "    _figure(1, 1)\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc.name, str(exc))\n"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MissingExtra matplotlib ")
    assert "sfq-scheduler[sim]" in out.stdout


def test_py_typed_shipped():
    import importlib.resources

    assert importlib.resources.files("sfq").joinpath("py.typed").is_file()


def test_dashboard_page_shipped():
    """``sfq serve``'s ``GET /dashboard`` page is package data (in the wheel, not only in the tree)."""
    import importlib.resources

    page = importlib.resources.files("sfq.serve").joinpath("dashboard.html")
    assert page.is_file() and b"<script>" in page.read_bytes()


@pytest.mark.parametrize("mypyc", ["1", ""], ids=["SFQ_MYPYC=1", "engine-as-source"])
def test_failed_compile_leaves_no_stale_extension(tmp_path, mypyc):
    """A reused tree keeps the last build's .so in build/; a failed compile must remove it,
    or the wheel ships a module that was not built from its sources. So must a build that
    leaves the engine as source (``build_ext`` alone, as in an editable install): the
    engine's modules and record from an earlier build go."""
    import importlib.util
    import shutil
    import sysconfig
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "setup.py").is_file():
        pytest.skip("needs the source tree (the tests run here against an installed wheel)")
    pytest.importorskip("Cython")
    tree = tmp_path / "tree"
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, tree / name)
    shutil.copytree(root / "src" / "csfq", tree / "src" / "csfq", ignore=shutil.ignore_patterns("*.c", "*.html"))
    shutil.copytree(root / "python", tree / "python", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    lib = tree / "build" / "lib"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    # the core, and the engine compiled by mypyc: a module, the library they share, the record
    stales = [lib / "sfq" / ("_csfq" + suffix), lib / "sfq" / "engine" / ("pool" + suffix),
              lib / ("sfq__mypyc" + suffix), lib / "sfq" / "_mypyc.json"]
    for stale in stales:
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_bytes(b"an old build")
        os.utime(stale, (0, 0))  # older than the sources, as after an edit
    env = {**os.environ, "CC": "false", "SFQ_REQUIRE_EXTENSIONS": "0", "SFQ_NO_EXTENSIONS": "0", "SFQ_MYPYC": mypyc}
    out = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", "build/lib"],
        cwd=tree, capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr  # optional build: the install goes on
    assert "the pure-Python twin will be used" in out.stdout
    if not mypyc:  # build_ext alone does not compile the engine, and says so
        assert "request engine runs from its source in this build (SFQ_MYPYC=1 compiles it)" in out.stdout
    elif importlib.util.find_spec("mypyc") is not None:  # (the build's own requirement; the test extra has it)
        assert "request engine was not compiled" in out.stdout
    assert [s for s in stales if s.exists()] == []


@pytest.mark.skipif(not os.environ.get("SFQ_TEST_INSTALLED"), reason="only when testing an installed wheel")
def test_the_installed_wheel_is_what_runs():
    """Set by .ci/wheel: the suite must exercise the installed package and its compiled core."""
    import sysconfig

    assert sfq.__file__.startswith(sysconfig.get_paths()["platlib"]), sfq.__file__
    assert sfq.CORE == "compiled"
    assert sfq.Scheduler.__module__ == "sfq._csfq"
    from sfq._compiled import engine_status

    assert engine_status() == "compiled"
