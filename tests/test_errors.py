"""One error tree: every exception class the packages define is a T1Error, ends in ``Error``, and is drawn in
the tree in protocol/errors.py's docstring (so a reader finds every error in one place)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from t1async.protocol import errors
from t1async.protocol.errors import T1Error

ROOT = Path(__file__).resolve().parent.parent
# internal signals that never leave their module's callers, with the reason they stay outside the tree
EXEMPT = {
    "sandbox_agent.sandbox.shell.ShellEOF": "control flow inside the sandbox (shell channel to sandbox), never seen",
}


def exception_classes() -> list[tuple[str, str]]:
    """(module, class name) of every public class defined at module level that subclasses BaseException."""
    found = []
    for top in ("t1async", "actors", "sandbox_agent"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "fixtures" in path.parts or path.name == "__main__.py":
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            names = [n.name for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)]
            if not names:
                continue
            mod = importlib.import_module(module)
            for name in names:
                obj = getattr(mod, name)
                if isinstance(obj, type) and issubclass(obj, BaseException) and not name.startswith("_"):
                    found.append((module, name))
    return found


CLASSES = exception_classes()


def test_the_walk_finds_the_known_leaves():
    names = {n for _, n in CLASSES}
    assert {"T1Error", "WireError", "ChunkError", "SandboxPathError", "SamplerUnreachableError"} <= names


@pytest.mark.parametrize(("module", "name"), CLASSES, ids=[f"{m}.{n}" for m, n in CLASSES])
def test_every_exception_is_in_the_tree_and_named_for_an_error(module, name):
    if f"{module}.{name}" in EXEMPT:
        return
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, T1Error), f"{module}.{name} is not a T1Error: derive it from the branch that fits"
    assert name.endswith("Error"), f"{module}.{name}: exception classes end in Error"
    assert f" {name} " in errors.__doc__, f"{module}.{name} is not drawn in errors.py's tree"
