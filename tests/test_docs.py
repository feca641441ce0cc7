"""The README and docs/ stay true: every command they show runs `--help`, every flag they name for a command
exists in that command's `--help`, and every relative link (and #anchor) resolves. The README stays short,
every `design §N` pointer in the code names a numbered section of docs/design.md, and no comment or docstring
cites an issue number of the tracker."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# a command is a module name that ends where the name ends: `t1async.recipes.warmstart --recipe` is the warmstart
# module's flag, not `t1async.learner`'s, and `t1async.recipes.presets.PRESETS` is no command at all
MODULES = (
    r"t1async\.(?:cluster|learner|sampler|eval)(?:\.[a-z_]+)*(?![\w.])"
    r"|actors|sandbox_agent|bench\.[a-z][a-z_]*(?![\w.])"
)
COMMAND = re.compile(rf"(?:python -m |^)({MODULES})\b(.*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def segments(text: str) -> list[str]:
    """Inline code spans outside fenced blocks, and each line of the fenced blocks."""
    out: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append(line.strip())
        else:
            out.extend(re.findall(r"`([^`]+)`", line))
    return out


def commands(text: str) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(module, subcommands, flags) for every command the text shows."""
    found = []
    for seg in segments(text):
        m = COMMAND.search(seg.replace("\\|", "|"))
        if m is None:
            continue
        module, rest = m.group(1), m.group(2)
        subs = []
        for part in rest.split(" / "):
            words = part.split()
            if words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
                subs.append(words[0])
        found.append((module, tuple(subs), FLAG.findall(rest)))
    return found


@cache
def help_text(module: str, sub: str | None) -> str:
    argv = [sys.executable, "-m", module, *([sub] if sub else []), "--help"]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert res.returncode == 0, f"`{' '.join(argv[1:])}` failed: {res.stderr[-500:]}"
    return res.stdout


def all_commands() -> list[tuple[Path, str, tuple[str, ...], list[str]]]:
    return [(doc, *c) for doc in DOCS for c in commands(doc.read_text(encoding="utf-8"))]


def test_every_command_and_flag_in_the_docs_exists_in_its_help():
    cmds = all_commands()
    assert {m for _, m, _, _ in cmds} >= {"t1async.cluster", "actors", "t1async.learner", "sandbox_agent"}
    wanted = {(m, s) for _, m, subs, _ in cmds for s in (subs or (None,))}
    with ThreadPoolExecutor(4) as pool:  # warm the cache: each --help is a fresh interpreter
        list(pool.map(lambda ms: help_text(*ms), sorted(wanted, key=str)))
    missing = []
    for doc, module, subs, flags in cmds:
        helps = "\n".join(help_text(module, s) for s in (subs or (None,)))
        missing += [
            f"{doc.name}: `{module} {' / '.join(subs)}` has no {f}" for f in flags if not re.search(rf"{f}\b", helps)
        ]
    assert not missing, "\n".join(missing)


def test_the_cluster_up_flags_paragraph_names_real_flags():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    para = readme[readme.index("`cluster up` flags") :]
    para = para[: para.index("\n\n")]
    flags = set(FLAG.findall(para))
    assert len(flags) > 10
    up = help_text("t1async.cluster", "up")
    assert not [f for f in flags if not re.search(rf"{f}\b", up)]


def test_a_made_up_flag_would_be_caught():
    """The checker itself: a doc naming a flag the command lacks is reported."""
    ((module, subs, flags),) = commands("run `python -m t1async.cluster status --json --bogus-flag`")
    assert (module, subs) == ("t1async.cluster", ("status",)) and flags == ["--json", "--bogus-flag"]
    assert "--bogus-flag" not in help_text("t1async.cluster", "status")
    assert commands("`python -m t1async.cluster down / status [--json] / tail [SUBJECT]`")[0][1] == (
        "down",
        "status",
        "tail",
    )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)
    if doc.name == "README.md":
        assert {"docs/design.md", "docs/results.md", "docs/glossary.md", "docs/reading-a-run.md"} <= set(links)


def test_docs_cover_the_dashboard_and_tail_fields():
    """The glossary explains every turn field `tail --fields` knows and every dashboard line."""
    from t1async.cluster.glossary import TURN_FIELDS

    glossary = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    for f in TURN_FIELDS:
        if f in ("drift", "timing", "action", "obs", "text"):
            continue  # shown as prev/clean/DRIFT, sample/exec and the indented lines, each explained
        assert f"| `{f}` |" in glossary, f
    for line in ("### run", "### actors", "### sampler", "### learner", "### nats and eval"):
        assert line in glossary


def test_sft_help_keeps_its_examples_apart_and_explains_every_flag():
    out = help_text("t1async.learner", "sft")
    lines = out.splitlines()
    assert "  python -m t1async.learner sft --synth 64 --steps 300 --out runs/sft" in lines, "one example per line"
    opts = out[out.index("options:") :]
    for flag in ("--lr", "--seed"):
        line = next(x for x in opts.splitlines() if x.strip().split()[:1] == [flag])
        flag_and_metavar = " ".join(line.split()[:2])
        assert len(line.strip()) > len(flag_and_metavar) + 5, f"{flag} has no help: {line!r}"


def test_the_readme_is_short():
    """A newcomer's page: measurements live in docs/results.md, explanations in docs/design.md."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/design.md or docs/results.md"


# --- `design §N` pointers -----------------------------------------------------------------------------------

CODE_DIRS = ("t1async", "actors", "sandbox_agent", "bench", "tests")
POINTER = re.compile(r"design §(\d+)((?:(?:, | and )§\d+)*)")
OLD_SPELLING = re.compile(r"DESIGN\s*§\d*")


def code_files() -> list[Path]:
    this = Path(__file__).resolve()
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p.resolve() != this]


def design_sections(text: str) -> set[int]:
    """The numbers of docs/design.md's `## §N Title` headings."""
    return {int(n) for n in re.findall(r"^## §(\d+) \S", text, flags=re.M)}


def pointer_problems(text: str, sections: set[int]) -> list[str]:
    """What is wrong with the `§` pointers in one file's text: a number design.md has no section for, the old
    `DESIGN §` spelling, or a `§N` that is not part of a `design §N` pointer (`design §3, §7` is one pointer)."""
    old = list(OLD_SPELLING.finditer(text))
    problems = [f"old spelling {m.group(0)!r}: write `design §N`" for m in old]
    covered = [m.span() for m in old]
    for m in POINTER.finditer(text):
        covered.append(m.span())
        for n in [m.group(1), *re.findall(r"§(\d+)", m.group(2))]:
            if int(n) not in sections:
                problems.append(f"`design §{n}`: no `## §{n}` in docs/design.md")
    for m in re.finditer(r"§\d+", text):
        if not any(a <= m.start() < b for a, b in covered):
            line = text[: m.start()].count("\n") + 1
            problems.append(f"line {line}: {m.group(0)} is not a `design §N` pointer")
    return problems


def test_design_sections_are_numbered_in_order():
    sections = re.findall(r"^## §(\d+) ", (ROOT / "docs" / "design.md").read_text(encoding="utf-8"), flags=re.M)
    assert [int(n) for n in sections] == list(range(1, len(sections) + 1)) and len(sections) >= 10


def test_every_design_pointer_in_the_code_resolves():
    sections = design_sections((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    bad = []
    for path in code_files():
        bad += [f"{path.relative_to(ROOT)}: {p}" for p in pointer_problems(path.read_text(encoding="utf-8"), sections)]
    for doc in DOCS:  # the docs may say "§N" alone (design.md about itself), but only of sections that exist
        text = doc.read_text(encoding="utf-8")
        bad += [f"{doc.name}: {m.group(0)}" for m in OLD_SPELLING.finditer(text)]
        bad += [f"{doc.name}: §{n} does not exist" for n in re.findall(r"§(\d+)", text) if int(n) not in sections]
    assert not bad, "\n".join(bad)


def test_a_broken_design_pointer_would_be_caught():
    """The checker itself: a pointer to a missing section, the old spelling, and a bare `§N` are reported."""
    sections = {1, 2, 3, 7}
    assert pointer_problems("# credits (design §7); tiling (design §3, §7)", sections) == []
    assert pointer_problems("# see design §12", sections) == ["`design §12`: no `## §12` in docs/design.md"]
    assert pointer_problems("# see design §3 and §9", sections) == ["`design §9`: no `## §9` in docs/design.md"]
    assert pointer_problems("# see DESIGN §3", sections) == ["old spelling 'DESIGN §3': write `design §N`"]
    assert pointer_problems("x = 1\n# (§3)", sections) == ["line 2: §3 is not a `design §N` pointer"]
    assert design_sections("## §1 What it is\n## §2 Layout\n### §9 not a section\n## §x\n") == {1, 2}


# --- no issue numbers in comments and docstrings --------------------------------------------------------------

ISSUE = re.compile(r"\bissues? *(?:#|no\.? *)?\d+|(?<![\w/&-])#\d+\b", re.I)
# another project's tracker, named, is a reference a reader can follow: `prime-rl #3255`
EXTERNAL = re.compile(r"(?:prime-rl|verl|sglang|vllm|pytorch|torch|nats-py|nats-server|trio|anyio) $", re.I)


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    out.append((body[0].lineno, body[0].value.value))
    return out


def issue_citations(source: str) -> list[str]:
    found = []
    for line, text in comments_and_docstrings(source):
        for m in ISSUE.finditer(text):
            if not EXTERNAL.search(text[: m.start()]):
                found.append(f"line {line}: {m.group(0)!r}")
    return found


def test_no_comment_or_docstring_cites_an_issue_number():
    bad = []
    for path in [*code_files(), Path(__file__)]:
        bad += [f"{path.relative_to(ROOT)} {c}" for c in issue_citations(path.read_text(encoding="utf-8"))]
    assert not bad, "say what the issue asked for, not its number:\n" + "\n".join(bad)


def test_an_issue_number_would_be_caught():
    """The checker itself: each way of citing the tracker is reported; other `#` uses are not."""
    src = (
        '"""Targets (issue 12): pass@1 up."""\n'
        "x = 1  # fixed in (#13)\n"
        "def f():\n"
        '    """As issue 9 item 5 asks; Issue #4 too."""\n'
        "# hashing thrashes the cache (prime-rl #3255)\n"
        'colour = "#999999"  # a colour, ep#0 is an episode id\n'
    )
    assert issue_citations(src) == [
        "line 2: '#13'",
        "line 1: 'issue 12'",
        "line 4: 'issue 9'",
        "line 4: 'Issue #4'",
    ]


# --- `*.py` paths named in comments and docstrings ------------------------------------------------------------

# a path ends at `.py`, and is not part of a longer path, a dotted name or a glob (`*_test.py`, `<ex>_test.py`)
PY_PATH = re.compile(r"(?<![\w./*<>{}-])((?:[\w.-]+/)*\w[\w-]*\.py)(?![\w/])")
# paths in another project's tree, which a comment may cite: SGLang's and vLLM's sources
EXTERNAL_PREFIXES = ("sglang/", "python/sglang/", "vllm/")
# files of a task's layout or of a verifier's work dir, not of this repository
TASK_FILES = {"test_outputs.py", "pytest.py", "conftest.py"}


def py_path_problems(path: Path, source: str) -> list[str]:
    """The `*.py` paths named in one file's comments and docstrings that name no file. A path resolves against
    the repository root, `t1async/`, or the file's own package and the packages above it, so `protocol/wire.py`,
    `sampler/app.py` and a sibling's bare `engine.py` all resolve."""
    bases = [ROOT, ROOT / "t1async", *[d for d in path.parents if d == ROOT or ROOT in d.parents]]
    problems = []
    for line, text in comments_and_docstrings(source):
        for m in PY_PATH.finditer(text):
            name = m.group(1)
            if name.startswith(EXTERNAL_PREFIXES) or name.rsplit("/", 1)[-1] in TASK_FILES:
                continue
            if not any((base / name).is_file() for base in bases):
                problems.append(f"line {line + text[: m.start()].count(chr(10))}: {name} does not exist")
    return problems


def test_every_py_path_in_comments_and_docstrings_exists():
    """A renamed module leaves no stale name behind in the prose that points readers to it."""
    bad = []
    for path in code_files():
        if {"tb_tasks", "fixtures"} & set(path.relative_to(ROOT).parts):
            continue  # task data: its names are the task's files
        bad += [f"{path.relative_to(ROOT)} {p}" for p in py_path_problems(path, path.read_text(encoding="utf-8"))]
    assert not bad, "name the module by its current path:\n" + "\n".join(bad)


def test_a_stale_py_path_would_be_caught():
    """The checker itself: a module that is gone is reported, wherever it is named; the module's own package,
    its parent, the repository root, SGLang's tree, task files and globs are not."""
    here = ROOT / "t1async" / "sampler" / "app.py"
    src = (
        '"""Requests are parsed by protocol.py; responses in response.py (see also protocol/wire.py)."""\n'
        "# t1async/ingest/episode_assembly.py and ingest/assembly.py; sglang/srt/server_args.py\n"
        "def f():\n"
        '    """tests/test_outputs.py of a task, collected as test_*.py and *_test.py; README.md; a.pyc"""\n'
        "x = 1  # t1async/sampler/gone.py\n"
    )
    assert py_path_problems(here, src) == [
        "line 2: t1async/ingest/episode_assembly.py does not exist",
        "line 5: t1async/sampler/gone.py does not exist",
        "line 1: protocol.py does not exist",
    ]


# --- constraints --------------------------------------------------------------------------------------------


def test_the_constraints_pin_every_dependency_ci_installs():
    """constraints.txt (made by .ci/freeze from a venv that passed) pins one version of every package
    pyproject.toml asks for, the dev extra included, and .ci/run and the README install with it: a fresh
    machine gets what was tested."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = [Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and "+" not in version, f"constraints.txt: {line!r} is not NAME==VERSION (no local label)"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for req in wanted:
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"constraints.txt pins no {req.name}: run .ci/freeze after a green .ci/run"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} is not {req}"
    for doc in (ROOT / ".ci" / "run", ROOT / "README.md"):
        text = doc.read_text(encoding="utf-8")
        assert "-c constraints.txt" in text and "-c constraints-vllm.txt" in text, f"{doc.name} installs unpinned"
