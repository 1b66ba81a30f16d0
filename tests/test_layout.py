"""Imports run one way (docs/design.md): errors and the core -> the rules and model types
(``sfq.policy``) -> the estimator -> the request engine (``sfq.engine``) -> shared state and
backends -> the drivers (``sfq.dispatch``, ``sfq.serve``, ``sfq.sim``) -> the CLI. Nothing
below imports anything above, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "sfq"

#: these tests read the package's source: skipped where only tests/ and docs/ are copied (the wheel's run)
pytestmark = pytest.mark.skipif(not (PACKAGE / "__init__.py").exists(), reason="needs the source tree")
#: each layer, lowest first; a module may import its own layer and the ones below
LAYERS = [
    {"errors", "_common", "_core", "_csfq", "_scheduler_py", "_optional", "_compiled"},
    {"policy"},
    {"cost"},
    {"engine"},
    {"state", "backends"},
    {"dispatch", "demo", "asgi"},
    {"serve", "sim"},
    {"cli", "_cli_help", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def top(module: str) -> str:
    return module.split(".")[0]


def imported(path: Path) -> set[str]:
    """The top-level sfq subpackages or modules ``path`` imports (absolute or relative)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    pkg = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = [*base, *(node.module.split(".") if node.module else [])]
                if target:
                    out.add(target[0])
                else:  # "from . import x" at the package root
                    out.update(a.name for a in node.names)
            elif node.module and node.module.startswith("sfq."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("sfq."))
    return out


def test_every_module_is_in_a_layer() -> None:
    names = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*")
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert names - {"__init__"} <= set(RANK), sorted(names - {"__init__"} - set(RANK))


def test_no_import_runs_back_up() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        me = rel.parts[0].removesuffix(".py")
        if me == "__init__":
            continue  # the package's face re-exports from every layer, lazily
        for name in imported(path):
            if name in RANK and RANK[name] > RANK[me]:
                upward.append(f"{rel} imports sfq.{name}")
    assert upward == []
