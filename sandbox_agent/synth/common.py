"""Shared pieces of the task families: the ``SynthSpec`` record, word lists, test-file scaffolding."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Every generated test file starts with this: tests find the work dir from T1_WORKDIR (set by the
# verifier), else the current directory (the verifier runs them with cwd = the work dir).
TEST_HEADER = '''\
import json
import os
import stat
import subprocess
from pathlib import Path

WORK = Path(os.environ.get("T1_WORKDIR") or os.getcwd())


def run(cmd, **kw):
    """Run a shell command in the work dir with a clean environment; returns CompletedProcess."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    env.update(kw.pop("env", {}))
    kw.setdefault("timeout", 30)
    return subprocess.run(
        cmd, shell=True, executable="/bin/bash", cwd=WORK, env=env, capture_output=True, text=True, **kw
    )


def read(rel):
    p = WORK / rel
    assert p.is_file(), f"{rel} does not exist"
    return p.read_text()


def lines(rel):
    return [ln for ln in read(rel).splitlines() if ln.strip()]
'''


@dataclass(frozen=True)
class SynthSpec:
    family: str
    instruction: str
    solution: str  # bash, run with cwd = the work dir
    tests: str  # the body of tests/test_outputs.py after TEST_HEADER
    files: dict[str, str | bytes] = field(default_factory=dict)  # environment/ files (relative path -> content)
    modes: dict[str, int] = field(default_factory=dict)  # chmod for environment files
    setup: str | None = None  # setup.sh (runs in the sandbox before the agent)
    difficulty: str = "easy"
    tags: tuple[str, ...] = ()


WORDS = (
    "alpha bravo cedar delta ember falcon garnet harbor indigo juniper kestrel lagoon maple nectar "
    "orchid pepper quartz raven saffron tundra umber velvet willow xenon yarrow zephyr amber basil "
    "cobalt dune fjord glacier hazel iris jade kelp lotus mango nova olive prism quill ridge sage "
    "thistle ursa violet wren yucca zinc anchor beacon canyon drift echo flint grove heron"
).split()
CITIES = "berlin lisbon osaka quito tunis oslo lima perth cairo dakar hanoi riga".split()
NAMES = (
    "ada alan barbara carl dana edgar fatima grace hugo ines jonas kira liam mona nils olga pablo "
    "quinn rosa sven tara uma victor wanda xavi yara zoe"
).split()
EXTS = ("txt", "log", "csv", "md", "json", "dat", "cfg", "py")


def pick(rng: random.Random, seq, k: int) -> list:
    return rng.sample(list(seq), k)


def word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def ident(rng: random.Random, n: int = 2) -> str:
    return "_".join(rng.sample(WORDS, n))


def para(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))
