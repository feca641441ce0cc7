"""Shared pieces of the task families: the ``SynthSpec`` record, word lists, test-file scaffolding."""

from __future__ import annotations

import hashlib
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
    # what makes two tasks the same task (the split hashes it, so held-out keys never reach training): a family
    # whose checks ignore an order or a wording it draws sets it; "" = ``content_key``'s digest of the checks
    content_key: str = ""
    # turns the agent gets on this task (task.yaml ``max_turns``, honoured by ``runner.run_episode`` under the
    # agent's own limit): a family sets it to exactly the oracle's turns, so a turn more than needed is no free
    # retry; None: the agent's limit only
    max_turns: int | None = None


def content_key(spec: SynthSpec) -> str:
    """The spec's own key, else ``<family>:<digest>`` of what its tests check and the inputs they check it on
    (tests, environment files and modes, setup): the same final state asked for on the same inputs is the
    same task, however the instruction words it."""
    if spec.content_key:
        return spec.content_key
    h = hashlib.sha256(spec.tests.encode())
    for rel in sorted(spec.files):
        body = spec.files[rel]
        h.update(b"\0" + rel.encode() + b"\0" + (body if isinstance(body, bytes) else body.encode()))
        h.update(oct(spec.modes.get(rel, 0o644)).encode())
    h.update(b"\0setup\0" + (spec.setup or "").encode())
    return f"{spec.family}:{h.hexdigest()[:16]}"


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
