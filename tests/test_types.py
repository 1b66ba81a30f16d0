"""What type checkers see is what runs: the lazy names of ``sfq`` have TYPE_CHECKING
imports, the two scheduler twins expose one surface, and the compiled core's stub
(``_csfq.pyi``) declares exactly that surface, with the twin's parameter names."""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path

import pytest

import sfq
from sfq import _scheduler_py as twin

PKG = Path(sfq.__file__).resolve().parent


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def _type_checking_imports() -> dict[str, str]:
    """name -> module (relative, ".backends") imported under ``if TYPE_CHECKING:`` in sfq/__init__.py."""
    tree = ast.parse((PKG / "__init__.py").read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                for alias in imp.names:
                    out[alias.asname or alias.name] = "." * imp.level + (imp.module or "")
    return out


def test_every_lazy_name_is_visible_to_type_checkers():
    assert _type_checking_imports() == sfq._LAZY
    for name in sfq._LAZY:
        assert name in sfq.__all__, name


def test_lazy_names_resolve_to_their_modules():
    for name, mod in sfq._LAZY.items():
        assert getattr(sfq, name) is getattr(importlib.import_module(mod, "sfq"), name)


def _compiled():
    try:
        return importlib.import_module("sfq._csfq")
    except ImportError:  # pragma: no cover - a build without the extension
        pytest.skip("the compiled core is not built")


def test_both_twins_expose_the_same_surface():
    c = _compiled()
    assert _public(c.Scheduler) == _public(sfq.ReferenceScheduler)
    assert _public(c.Dispatch) == _public(twin.Dispatch)
    assert c.Dispatch.__name__ == twin.Dispatch.__name__ == sfq.Dispatch.__name__ == "Dispatch"
    assert twin.ReferenceDispatch is twin.Dispatch  # the older name, kept as an alias


def _stub_classes() -> dict[str, dict[str, ast.FunctionDef]]:
    tree = ast.parse((PKG / "_csfq.pyi").read_text(encoding="utf-8"))
    out: dict[str, dict[str, ast.FunctionDef]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members: dict[str, ast.FunctionDef] = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members[item.name] = item
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = None  # type: ignore[assignment]  # a plain attribute
            out[node.name] = members
    return out


@pytest.mark.parametrize("stub_name, twin_name", [("Scheduler", "ReferenceScheduler"), ("Dispatch", "Dispatch")])
def test_stub_declares_the_twins_surface(stub_name, twin_name):
    cls = getattr(twin, twin_name)
    members = _stub_classes()[stub_name]
    public = {n for n in members if not n.startswith("_")}
    assert public == _public(cls), "stub and twin differ"
    for name, fn in members.items():
        if fn is None or name.startswith("__") and name != "__init__":
            continue
        is_property = any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
        attr = inspect.getattr_static(cls, name)
        if is_property:
            # a property or a slot: a value, not a method
            assert isinstance(attr, (property, types.MemberDescriptorType)), f"{twin_name}.{name} is a value in the stub"
            continue
        stub_params = [a.arg for a in fn.args.args]
        twin_params = list(inspect.signature(attr).parameters)
        assert stub_params == twin_params, f"{twin_name}.{name}: stub {stub_params} vs twin {twin_params}"
