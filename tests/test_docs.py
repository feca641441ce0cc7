"""The README and docs/ stay true: every command they show runs `--help`, every flag they name for a command
exists in that command's `--help`, and every relative link (and #anchor) resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
        assert {"docs/design.md", "docs/glossary.md", "docs/reading-a-run.md"} <= set(links)


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
    for flag in ("--lr LR", "--seed SEED"):
        line = next(x for x in opts.splitlines() if x.strip().startswith(flag))
        assert len(line.strip()) > len(flag) + 5, f"{flag} has no help: {line!r}"
