"""Every package says what it exports: ``__all__`` exists, names only what resolves, once each, and lists
every public name the ``__init__`` itself defines. (Packages that import nothing export nothing: their
modules are imported directly.)"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts)
    for top in ("t1async", "actors", "sandbox_agent", "bench")
    for p in (ROOT / top).rglob("__init__.py")
    if "fixtures" not in p.parts
)


def defined_names(init: Path) -> set[str]:
    """Public names the __init__ binds by def, class or assignment (not by import)."""
    names: set[str] = set()
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names.add(t.id)
    return {n for n in names if not n.startswith("_")}


def test_every_package_is_found():
    assert {"t1async", "t1async.cluster", "t1async.transport", "actors", "sandbox_agent.sandbox"} <= set(PACKAGES)


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_declared_and_true(name):
    pkg = importlib.import_module(name)
    exported = getattr(pkg, "__all__", None)
    assert isinstance(exported, (list, tuple)), f"{name}/__init__.py has no __all__"
    assert all(isinstance(x, str) for x in exported) and len(set(exported)) == len(exported), f"{name}: {exported}"
    for x in exported:
        if not hasattr(pkg, x):
            importlib.import_module(f"{name}.{x}")  # a submodule named in __all__ must import
    init = ROOT.joinpath(*name.split("."), "__init__.py")
    missing = defined_names(init) - set(exported)
    assert not missing, f"{name}: public names defined in __init__ but not in __all__: {sorted(missing)}"
