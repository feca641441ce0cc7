"""Wheels from PyPI, fetched on the host, for images and for a task's offline verifier.

The host reaches PyPI; a verifier container does not (it runs with ``--network=none``). Most published test
scripts install their pins at verification time (``uv pip install pytest==8.4.1 numpy==2.2.1``, ``uvx -w
pyyaml==6.0.1 pytest``, ``pip install requests``). ``script_packages`` reads those requirement specs out of
the script, and ``task_wheelhouse`` downloads them once (with the base image's pytest wheels) into a
directory cached by the specs, which the verifier mounts over the image's wheelhouse: the script then runs
as written, offline, with the packages it asked for.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from sandbox_agent.images.wheelhouse import WHEELHOUSE_PACKAGES, cache_dir
from t1async.log import get_logger

log = get_logger("sandbox_agent.images.wheels")

PYTHON_VERSION = "3.11"  # the base image's (Debian bookworm's) python3
# glibc 2.36 (bookworm) runs any manylinux wheel up to 2_36; pip takes the platforms it is given literally
PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in (36, 35, 34, 31, 28, 27, 24, 17)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "any",
)

_SPEC = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?((==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!,<>=~-]+)?$")
_VALUE_FLAGS = frozenset(
    "-r --requirement -c --constraint -e --editable -i --index-url --extra-index-url --index --default-index "
    "-f --find-links -p --python -t --target --prefix --root --python-version --platform --cache-dir "
    "--from -o --output-file --group --extra".split()
)
_WITH = ("-w", "--with")


def _commands(text: str) -> list[list[str]]:
    """The script's simple commands as word lists (continuations joined, comments and operators split)."""
    out: list[list[str]] = []
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        if line.lstrip().startswith("#"):
            continue
        try:
            lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
            lex.whitespace_split = True
            lex.commenters = "#"
            words = list(lex)
        except ValueError:
            continue
        cur: list[str] = []
        for w in words:
            if w and set(w) <= set(";&|()"):
                if cur:
                    out.append(cur)
                cur = []
            else:
                cur.append(w)
        if cur:
            out.append(cur)
    return out


def _installs(words: list[str]) -> list[str]:
    """Requirement specs one command installs: ``[uv] pip install``, ``python -m pip install``, ``uv add``,
    and the ``--with``/``-w`` of ``uvx``/``uv run``/``uv tool run``."""
    names = [w.rsplit("/", 1)[-1] for w in words]
    args: list[str] = []
    positional = False
    for i in range(len(names)):
        tail = names[i : i + 3]
        if tail[:2] in (["pip", "install"], ["pip3", "install"]) or tail[:2] == ["uv", "add"]:
            args, positional = words[i + 2 :], True
            break
        if tail[:3] == ["uv", "pip", "install"]:
            args, positional = words[i + 3 :], True
            break
        if names[i] == "uvx" or tail[:2] == ["uv", "run"] or tail[:3] == ["uv", "tool", "run"]:
            args = words[i + 1 + (tail[:2] == ["uv", "run"]) + 2 * (tail[:3] == ["uv", "tool", "run"]) :]
            break
    specs: list[str] = []
    skip = False
    for j, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in _WITH and j + 1 < len(args):
            specs.append(args[j + 1])
            skip = True
        elif a.startswith("--with="):
            specs.append(a.partition("=")[2])
        elif a in _VALUE_FLAGS:
            skip = True
        elif a.startswith("-") or not positional:
            if not positional and not a.startswith("-"):
                break  # uvx's tool (or uv run's command): its own arguments follow
            continue
        else:
            specs.append(a)
    return [s for s in (x.strip() for spec in specs for x in spec.split(",")) if _SPEC.match(s)]


def script_packages(text: str) -> tuple[str, ...]:
    """The requirement specs a test script installs, in order, each once."""
    seen: dict[str, None] = {}
    for words in _commands(text):
        for s in _installs(words):
            seen.setdefault(s, None)
    return tuple(seen)


def download(dest: Path, specs: tuple[str, ...] | list[str]) -> subprocess.CompletedProcess[str]:
    """``pip download`` binary wheels of ``specs`` (and their dependencies) for the base image's Python."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", PYTHON_VERSION]
        + platforms
        + ["--disable-pip-version-check", "-d", str(dest), *specs],
        capture_output=True,
        text=True,
        timeout=900,
    )


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def task_wheelhouse(cache: Path, specs: tuple[str, ...], base: tuple[str, ...]) -> tuple[Path | None, str]:
    """A directory with wheels of ``base`` + ``specs``, downloaded once per set of specs under ``cache``;
    (None, why) when they cannot be had (no network, no wheel for this Python, an unknown package)."""
    if not specs:
        return None, ""
    key = hashlib.sha256("\n".join(sorted(set(base + specs))).encode()).hexdigest()[:16]
    done = cache / "verifier-wheels" / key
    marker = done / ".complete"
    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        if marker.exists():
            return done, ""
        part = done.with_name(f"{key}.part-{os.getpid()}")  # actor processes may fetch the same set at once
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        r = download(part, base)  # two resolutions: a script may pin another pytest than the image's
        if r.returncode == 0:
            r = download(part, specs)
        if r.returncode != 0:
            shutil.rmtree(part, ignore_errors=True)
            why = " | ".join(ln for ln in r.stderr.strip().splitlines()[-2:])[-300:]
            log.info("wheels.task_download_failed", specs=list(specs), why=why)
            return None, f"could not fetch {' '.join(specs)} from PyPI: {why}"
        (part / ".complete").write_text(" ".join(specs) + "\n")
        try:
            part.rename(done)
        except OSError:  # another process got there first (a non-empty `done`): theirs serves
            shutil.rmtree(part, ignore_errors=True)
            if not marker.exists():
                return None, f"could not place the wheels for {' '.join(specs)} in {done}"
        log.info("wheels.task_downloaded", specs=list(specs), dir=str(done))
        return done, ""


def verifier_wheels(task_script: Path | None) -> tuple[Path | None, tuple[str, ...], str]:
    """(wheelhouse to mount over the image's, the specs beyond the image's own, why not) for a test script."""
    if task_script is None:
        return None, (), ""
    try:
        specs = script_packages(task_script.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None, (), ""
    have = {s.lower() for s in WHEELHOUSE_PACKAGES}
    extra = tuple(s for s in specs if s.lower() not in have)
    house, why = task_wheelhouse(cache_dir(), extra, WHEELHOUSE_PACKAGES)
    return house, extra if house else (), why
