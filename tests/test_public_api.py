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


MODULES = sorted(
    p
    for top in ("t1async", "actors", "sandbox_agent", "bench")
    for p in (ROOT / top).rglob("*.py")
    if "fixtures" not in p.parts and p.name != "__init__.py"
)


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Names a module binds by a top-level ``from M import N``: name -> M."""
    return {
        a.asname or a.name: node.module or ""
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }


def test_a_module_exports_only_what_it_defines():
    """No re-exports outside a package's ``__init__``: a name has one import path, the module that defines it
    (old paths kept "for compatibility" were removed, and must not come back)."""
    shims = []
    for path in MODULES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exported: list[str] = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
        imported = imported_names(tree)
        shims += [f"{path.relative_to(ROOT)}: {n} (from {imported[n]})" for n in exported if n in imported]
    assert not shims, shims


def bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds itself at top level (def, class, assignment), also under if/try."""
    names: set[str] = set()
    for top in tree.body:
        for node in [top, *(ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [])]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_import_names_the_module_that_defines_it():
    """``from M import N`` (code, tests, bench) where M is a module, not a package: M defines N, it does not
    merely import it from elsewhere."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in MODULES}
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in modules.items()}
    defined = {m: bound_names(t) for m, t in trees.items()}
    users = [*MODULES, *sorted((ROOT / "tests").glob("*.py"))]
    through = []
    for path in users:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in trees:
                through += [
                    f"{path.relative_to(ROOT)}: {a.name} from {node.module}"
                    for a in node.names
                    if a.name not in defined[node.module] and a.name in imported_names(trees[node.module])
                ]
    assert not through, through


OURS = ("t1async", "actors", "sandbox_agent", "bench")


def private_imports(source: str, where: str) -> list[str]:
    """``from M import _n`` in ``source`` where M is one of our modules: reaching into another module's
    private name (``_n`` is its own business; give it a public name where it belongs)."""
    return [
        f"{where}:{node.lineno}: {a.name} from {node.module}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in OURS
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_name():
    """Code (t1async, actors, sandbox_agent, bench) imports no ``_name`` of ours. Tests may: a white-box test
    of a helper (``_parser``, ``_no_echo``) is worth more than making the helper public just for it, and
    nothing ships that depends on it. (A private *module*, ``bench._common``, is its package's business.)"""
    found = [h for p in MODULES for h in private_imports(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert not found, found


def test_the_private_import_check_can_fail():
    src = "import os\nfrom t1async.learner.checkpoint import _secret, optimizer_tensors\nfrom os import _exit\n"
    assert private_imports(src, "x.py") == ["x.py:2: _secret from t1async.learner.checkpoint"]


def imports_of_test_modules(source: str, where: str) -> list[str]:
    """Imports of a test module (``test_x``, ``tests.test_x``, as pytest and the repo root put them on the path)
    in ``source``: a test file reaching into another one for its helpers."""

    def is_test_module(name: str) -> bool:
        parts = name.split(".")
        return parts[-1].startswith("test_") and parts[:-1] in ([], ["tests"])

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [f"{where}:{node.lineno}: {n}" for n in names if is_test_module(n)]
    return found


def test_no_test_file_imports_another_test_file():
    """Helpers and fixtures that several test files share live in support modules under tests/ whose names do
    not start with ``test_`` (``tests.segments``, ``tests.loops``...), in tests/conftest.py, or in
    t1async.testing: importing a test file runs its module code again under a second name and hides what it
    shares."""
    found = [
        h
        for p in sorted((ROOT / "tests").glob("*.py"))
        for h in imports_of_test_modules(p.read_text(encoding="utf-8"), p.name)
    ]
    assert not found, found


def test_the_test_file_import_check_can_fail():
    src = (
        "import tests.test_a\nfrom test_b import x\nfrom tests.test_c import y\nfrom tests import test_d\n"
        "from tests.segments import tiny\nfrom t1async.testing import test_e\nimport testing\n"
    )
    assert imports_of_test_modules(src, "x.py") == [
        "x.py:1: tests.test_a",
        "x.py:2: test_b",
        "x.py:3: tests.test_c",
        "x.py:4: tests.test_d",
    ]
