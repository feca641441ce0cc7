"""The layers, and that imports run one way through them (docs/design.md, "Layers").

The import graph is read from the source with ``ast``, not from ``sys.modules``: every ``import`` and
``from ... import`` counts, those under ``if TYPE_CHECKING:`` and those inside functions too (a local import
hides a cycle from the interpreter, not from the design). ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``; ``import a.b.c`` is an edge to ``a.b.c``.

    base         t1async.log and t1async.procs (import nothing of ours); t1async.protocol (imports only
                 itself and the base)
    sandbox_agent   imports only itself, t1async.protocol and the base
    core         t1async.{protocol, transport, credits, ingest, learner, sampler, model, log, curves}:
                 imports only the core
    testing      t1async.testing (conformance kits): the core, sandbox_agent and itself
    applications t1async.{cluster, eval, recipes}, actors, bench, and every ``t1async.X.__main__`` (a
                 command line: ``python -m t1async.learner sft`` may import recipes): anything

and no module takes part in an import cycle (a package's ``__init__`` importing its submodules counts).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("t1async", "actors", "sandbox_agent", "bench")


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    file: str  # relative to the root
    line: int
    kind: str  # "module", "TYPE_CHECKING" or "local" (inside a function)

    def __str__(self) -> str:
        tag = "" if self.kind == "module" else f" [{self.kind}]"
        return f"{self.src} -> {self.dst}  ({self.file}:{self.line}){tag}"


def find_modules(root: Path, tops: tuple[str, ...]) -> dict[str, Path]:
    """Dotted name -> file, for every module of the given top-level packages (task fixtures are data)."""
    modules: dict[str, Path] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "fixtures" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Every import statement of one module, with where it sits: module level, TYPE_CHECKING, a function."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
        self._kind = ["module"]

    def _nested(self, kind: str, nodes: list[ast.stmt]) -> None:
        self._kind.append(kind)
        for n in nodes:
            self.visit(n)
        self._kind.pop()

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        if _is_type_checking(node.test):
            self._nested("TYPE_CHECKING" if self._kind[-1] == "module" else self._kind[-1], node.body)
        else:
            self._nested(self._kind[-1], node.body)
        self._nested(self._kind[-1], node.orelse)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._nested("local", node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._kind[-1]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._kind[-1]))


def _longest_known(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def build_graph(root: Path = ROOT, tops: tuple[str, ...] = TOPS) -> tuple[dict[str, Path], list[Edge]]:
    modules = find_modules(root, tops)
    edges: list[Edge] = []
    for name, path in modules.items():
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rel = str(path.relative_to(root))
        for node, kind in visitor.found:
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_longest_known(a.name, modules) for a in node.names]
            else:
                if node.level:  # relative: from . import x / from ..pkg import y
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else _longest_known(base, modules))
            for dst in dict.fromkeys(targets):  # once per statement and target
                if dst is not None and dst != name:
                    edges.append(Edge(name, dst, rel, node.lineno, kind))
    return modules, edges


# --- the layers ------------------------------------------------------------------------------------------

CORE = ("transport", "credits", "ingest", "learner", "sampler", "model", "curves", "config", "signals")
APPLICATIONS = ("t1async.cluster", "t1async.eval", "t1async.recipes", "actors", "bench")


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def layer(mod: str) -> str | None:
    """The layer a module belongs to; None for one no rule places (a new package must be given a layer)."""
    if mod == "t1async":
        return "root"  # the empty top package, imported along with any t1async module
    if mod.startswith("t1async.") and mod.endswith(".__main__"):
        return "application"  # a command line: may reach up to recipes (`python -m t1async.learner sft`)
    if _under(mod, "t1async.log") or _under(mod, "t1async.procs"):
        return "base"
    if _under(mod, "t1async.protocol"):
        return "protocol"
    if _under(mod, "sandbox_agent"):
        return "sandbox_agent"
    if _under(mod, "t1async.testing"):
        return "testing"
    if any(_under(mod, f"t1async.{c}") for c in CORE):
        return "core"
    if any(_under(mod, a) for a in APPLICATIONS):
        return "application"
    return None


# layer -> the layers it may import ("root", the empty t1async/__init__, may be imported by anyone)
ALLOWED: dict[str, set[str]] = {
    "root": set(),
    "base": set(),
    "protocol": {"protocol", "base"},
    "sandbox_agent": {"sandbox_agent", "protocol", "base"},
    "core": {"core", "protocol", "base"},
    "testing": {"testing", "core", "protocol", "base", "sandbox_agent"},
    "application": {"application", "testing", "core", "protocol", "base", "sandbox_agent"},
}
RULES = {
    "base": "t1async.log and t1async.procs (children that die with their parent) import nothing of ours",
    "protocol": "t1async.protocol imports nothing of ours but the base",
    "sandbox_agent": "sandbox_agent imports nothing of ours but t1async.protocol and the base (log, procs)",
    "core": "the core (t1async.{protocol, transport, credits, ingest, learner, sampler, model, log, curves}) "
    "never imports sandbox_agent, actors, t1async.{cluster, eval, recipes, testing} or bench",
    "testing": "t1async.testing imports only the core and sandbox_agent (no application)",
    "root": "the t1async package itself imports nothing of ours",
}


def layer_violations(edges: list[Edge], src_layer: str) -> list[Edge]:
    allowed = ALLOWED[src_layer] | {"root"}
    return [e for e in edges if layer(e.src) == src_layer and layer(e.dst) not in allowed]


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[list[str]]:
    """Tarjan's components of more than one module, each sorted, largest first."""
    succ: dict[str, list[str]] = defaultdict(list)
    for e in edges:
        succ[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found, key=lambda c: (-len(c), c))


def cycle_report(nodes: list[str], edges: list[Edge]) -> str:
    out = []
    for comp in strongly_connected(nodes, edges):
        members = set(comp)
        inside = sorted((e for e in edges if e.src in members and e.dst in members), key=lambda e: (e.src, e.line))
        out.append(f"cycle of {len(comp)} modules: {', '.join(comp)}\n" + "\n".join(f"    {e}" for e in inside))
    return "\n".join(out)


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], list[Edge]]:
    return build_graph()


# --- the tests on this repository ------------------------------------------------------------------------


def test_the_graph_is_read(graph):
    modules, edges = graph
    assert {"t1async.protocol.wire", "sandbox_agent.agent.loop", "actors.actor", "bench.learning"} <= set(modules)
    assert not any(m.startswith("sandbox_agent.fixtures") for m in modules)
    assert len(edges) > 300  # every import of ours, not only the module-level ones
    kinds = {e.kind for e in edges}
    assert {"module", "TYPE_CHECKING", "local"} <= kinds, kinds


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    unplaced = sorted(m for m in modules if layer(m) is None)
    assert not unplaced, f"modules in no layer (give them one in tests/test_layers.py): {unplaced}"


@pytest.mark.parametrize("src_layer", sorted(RULES))
def test_imports_follow_the_layers(graph, src_layer):
    _, edges = graph
    bad = layer_violations(edges, src_layer)
    assert not bad, f"{RULES[src_layer]}; these imports break it:\n" + "\n".join(
        f"  {e}  ({layer(e.src)} -> {layer(e.dst)})" for e in bad
    )


def test_no_import_cycles(graph):
    modules, edges = graph
    report = cycle_report(sorted(modules), edges)
    assert not report, "imports that form cycles (break one edge of each):\n" + report


# --- the checker itself, on a made-up tree: each rule can fail -------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> tuple[dict[str, Path], list[Edge]]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return build_graph(tmp_path, ("t1async", "sandbox_agent"))


def test_checker_sees_every_kind_of_import(tmp_path):
    _, edges = _tree(
        tmp_path,
        {
            "t1async/__init__.py": "",
            "t1async/log.py": "",
            "t1async/protocol/__init__.py": "",
            "t1async/protocol/wire.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from t1async.transport import base\n",
            "t1async/transport/__init__.py": "from t1async.transport.base import Transport\n",
            "t1async/transport/base.py": "from . import memory\nfrom .. import log\nimport t1async.protocol.wire\n"
            "def f():\n    from t1async.testing.kit import check\n",
            "t1async/transport/memory.py": "from t1async.transport import Transport\n",
            "t1async/testing/__init__.py": "",
            "t1async/testing/kit.py": "import sandbox_agent.agent.loop\nfrom t1async.recipes import sft\n",
            "t1async/recipes/__init__.py": "",
            "t1async/recipes/sft.py": "import t1async.testing.kit\n",
            "sandbox_agent/__init__.py": "",
            "t1async/curves.py": "",
            "t1async/learner/__init__.py": "",
            "t1async/learner/__main__.py": "def sft():\n    from t1async.recipes import sft\n",  # a command line
            "sandbox_agent/agent/loop.py": "from t1async import curves\n",
        },
    )
    got = {(e.src, e.dst, e.kind) for e in edges}
    assert got == {
        ("t1async.protocol.wire", "t1async.transport.base", "TYPE_CHECKING"),  # from pkg import module
        ("t1async.transport", "t1async.transport.base", "module"),  # an __init__ and its submodule
        ("t1async.transport.base", "t1async.transport.memory", "module"),  # relative
        ("t1async.transport.base", "t1async.log", "module"),
        ("t1async.transport.base", "t1async.protocol.wire", "module"),
        ("t1async.transport.base", "t1async.testing.kit", "local"),
        ("t1async.transport.memory", "t1async.transport", "module"),  # from pkg import name: the package
        ("t1async.testing.kit", "sandbox_agent.agent.loop", "module"),
        ("t1async.testing.kit", "t1async.recipes.sft", "module"),
        ("t1async.recipes.sft", "t1async.testing.kit", "module"),
        ("sandbox_agent.agent.loop", "t1async.curves", "module"),  # from the top package import a module
        ("t1async.learner.__main__", "t1async.recipes.sft", "local"),  # allowed: __main__ is an application
    }
    bad = {layer: {(e.src, e.dst) for e in layer_violations(edges, layer)} for layer in RULES}
    assert bad == {
        "root": set(),
        "base": set(),
        "protocol": {("t1async.protocol.wire", "t1async.transport.base")},
        "sandbox_agent": {("sandbox_agent.agent.loop", "t1async.curves")},
        "core": {("t1async.transport.base", "t1async.testing.kit")},
        "testing": {("t1async.testing.kit", "t1async.recipes.sft")},
    }
    comps = strongly_connected(sorted({e.src for e in edges} | {e.dst for e in edges}), edges)
    assert comps == [
        ["t1async.protocol.wire", "t1async.transport", "t1async.transport.base", "t1async.transport.memory"],
        ["t1async.recipes.sft", "t1async.testing.kit"],  # TYPE_CHECKING and local imports close cycles too
    ]
    assert "t1async/transport/memory.py:1" in cycle_report(sorted({e.src for e in edges}), edges)
