"""The synthetic task corpus: parametrised families written as Terminal-Bench 1 task directories.

Each task directory holds ``task.yaml`` (instruction, timeouts, family, split, content key), ``solution.sh``,
``run-tests.sh``, ``tests/test_outputs.py`` (>= 3 tests, so the dense reward is graded), the task's input
files under ``environment/`` (copied into the work dir before the agent starts, see
``sandbox_agent.tasks.task``) and, where needed, ``setup.sh`` (run in the sandbox first, e.g. to build a git
repo). Tests find the work dir from ``T1_WORKDIR`` or the current directory (the verifier sets both).

Task ``i`` of a corpus generated with seed ``S`` uses family ``FAMILIES[i % len(FAMILIES)]`` and a
``random.Random`` seeded from ``(S, i)``: the same ``(S, i)`` always gives the same task. The train/eval/test
split is a hash of the task's content key (``common.content_key``: what makes two tasks the same task, e.g. the
chore set), so every corpus, whatever its seed, holds out the same keys; ``split.json`` in the corpus dir lists
every task's split and key (``sandbox_agent.synth.split``).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from sandbox_agent.synth.basics import copy_family, mkfile_family
from sandbox_agent.synth.cdchores import cdchores_family, cdchoresfew_family, cdchoresome_family
from sandbox_agent.synth.chain import chain_family
from sandbox_agent.synth.chores import chores6_family, chores_family, choresome_family
from sandbox_agent.synth.choresn import choresn_family, choresnsome_family
from sandbox_agent.synth.common import TEST_HEADER, SynthSpec, content_key
from sandbox_agent.synth.contam import DECONTAMINATED, contaminated
from sandbox_agent.synth.data import archive_family, json_family
from sandbox_agent.synth.fsops import files_family, find_family, perms_family
from sandbox_agent.synth.micro import touch4_family, touchsome_family
from sandbox_agent.synth.observe import observe_family
from sandbox_agent.synth.shell import env_family, git_family, scripts_family
from sandbox_agent.synth.split import Entry, split_of, write_split_json
from sandbox_agent.synth.textproc import csv_family, logs_family, text_family
from t1async.protocol.errors import ConfigError

__all__ = [
    "ALL_FAMILIES",
    "corpus_entries",
    "EXTRA_FAMILIES",
    "FAMILIES",
    "RUN_TESTS",
    "generate",
    "make_task",
    "task_id",
    "task_rng",
    "write_task",
]

FAMILIES: dict[str, Callable[[random.Random], SynthSpec]] = {
    "files": files_family,
    "text": text_family,
    "csv": csv_family,
    "json": json_family,
    "archive": archive_family,
    "perms": perms_family,
    "git": git_family,
    "scripts": scripts_family,
    "find": find_family,
    "logs": logs_family,
    "env": env_family,
}
# families outside the default cycle (so the default corpus stays as it was): easy chores for learning from
# scratch, named explicitly (``families=[...]``, ``--families``), used by the ``learn`` preset
EXTRA_FAMILIES: dict[str, Callable[[random.Random], SynthSpec]] = {
    "mkfile": mkfile_family,
    "copy": copy_family,
    "touch4": touch4_family,  # one command, four tests: the CI learning test's family (synth/micro.py)
    "touchsome": touchsome_family,  # touch4 by a demonstrator that stops early: the CI test's warm start
    "chores": chores_family,  # fixed-menu chores, no copying: the learn preset's family (synth/chores.py)
    "choresome": choresome_family,  # chores by a demonstrator that stops early: the learn warm start
    "cdchores": cdchores_family,  # chores after a `cd` that earns nothing by itself (synth/cdchores.py)
    "cdchoresome": cdchoresome_family,  # cdchores by a demonstrator that stops early: the credit warm start
    "cdchoresfew": cdchoresfew_family,  # ... that never does all four: the credit-rare warm start
    "chores6": chores6_family,  # six chores in three replies: bench.learning's recombination OOD family
    # content-dependent families: when to stop, or what to act on, depends on what was asked or printed
    "choresn": choresn_family,  # n in 2..6 chores, max_turns exactly the oracle's; n = 5 held out (synth/choresn.py)
    "choresnsome": choresnsome_family,  # choresn by a demonstrator that stops after k replies, whatever n is
    "observe": observe_family,  # act on a name only a `cat` or `ls` prints (synth/observe.py)
    "chain": chain_family,  # 8-12 chores one a reply, max_turns 9-13 (synth/chain.py)
}
ALL_FAMILIES = {**FAMILIES, **EXTRA_FAMILIES}

RUN_TESTS = """\
#!/bin/bash
# Terminal-Bench 1 entry point. The t1async verifier does not use it: it runs tests/ directly with the
# sandbox's python3 -m pytest (no network to install pytest), with cwd = the work dir and T1_WORKDIR set.
cd "${T1_WORKDIR:-$PWD}"
python3 -m pytest -rA "${TEST_DIR:-$(dirname "$0")/tests}/test_outputs.py"
"""


def task_rng(seed: int, index: int, family: str) -> random.Random:
    h = hashlib.sha256(f"t1synth/{seed}/{index}/{family}".encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


def task_id(family: str, seed: int, index: int) -> str:
    return f"synth-{family}-s{seed}-{index:05d}"


def make_task(family: str, seed: int, index: int) -> tuple[str, SynthSpec]:
    """Task ``index`` of family ``family`` in the corpus of seed ``seed``: its id and spec (content key set)."""
    if family not in ALL_FAMILIES:
        raise ConfigError(f"unknown task family {family!r}; known: {', '.join(ALL_FAMILIES)}")
    spec = ALL_FAMILIES[family](task_rng(seed, index, family))
    return task_id(family, seed, index), replace(spec, content_key=content_key(spec))


def corpus_entries(
    n: int, seed: int, families: list[str], *, fold: int | None = None, folds: int = 0
) -> dict[str, Entry]:
    """task id -> (split, content key, family) of ``generate(out, n, seed, families, fold=, folds=)``, computed
    without writing a task (e.g. the warm start's SFT corpus, to check a bench corpus's held-out keys against
    it). A task in no split of the fold (``split.split_of``: a key kept for the untouched fold) is left out."""
    return {
        tid: (split, spec.content_key, spec.family)
        for tid, (split, spec) in _specs(n, seed, families, fold, folds).items()
    }


def _specs(n: int, seed: int, families: list[str], fold: int | None, folds: int) -> dict[str, tuple[str, SynthSpec]]:
    """task id -> (split, spec) of the corpus: the tasks in a split of the fold, less the train tasks of the
    ``contam.DECONTAMINATED`` families that overlap a test task of the corpus (``contam.contaminated``)."""
    out: dict[str, tuple[str, SynthSpec]] = {}
    for i in range(n):
        tid, spec = make_task(families[i % len(families)], seed, i)
        split = split_of(spec.content_key, fold=fold, folds=folds)
        if split is not None:
            out[tid] = (split, spec)
    train = {t: s for t, (sp, s) in out.items() if sp == "train" and s.family in DECONTAMINATED}
    if train:
        dropped = contaminated(train, {t: s for t, (sp, s) in out.items() if sp == "test"})
        for t in dropped:
            del out[t]
    return out


def _yaml_block(text: str, indent: str = "  ") -> str:
    return "|-\n" + "\n".join(indent + ln if ln else "" for ln in text.splitlines())


def write_task(
    out: Path,
    tid: str,
    spec: SynthSpec,
    *,
    agent_timeout_s: float = 3600.0,
    test_timeout_s: float = 60.0,
    split: str | None = None,
) -> Path:
    """Write one task directory ``out/tid`` (replacing any old one) and return its path. The agent timeout
    leaves room for a 300+-turn episode: in a default ``cluster up`` on a loaded 2-core box (8 episodes sharing
    the embedded sampler and the learner) an episode ran 0.26 turns/s, so 320 turns take ~20 min."""
    d = out / tid
    key = content_key(spec)
    if d.exists():
        shutil.rmtree(d)
    (d / "tests").mkdir(parents=True)
    yaml = "\n".join(
        [
            f"id: {tid}",
            f"instruction: {_yaml_block(spec.instruction)}",
            "author_name: t1async synth",
            f"difficulty: {spec.difficulty}",
            f"category: {spec.family}",
            f"family: {spec.family}",
            f"split: {split or split_of(key)}",
            f"content_key: {json.dumps(key)}",
            "tags: [" + ", ".join(spec.tags) + "]",
            "parser_name: pytest",
            f"max_agent_timeout_sec: {agent_timeout_s:g}",
            f"max_test_timeout_sec: {test_timeout_s:g}",
            "run_tests_in_same_shell: false",
            *([f"max_turns: {spec.max_turns}"] if spec.max_turns is not None else []),
            "",
        ]
    )
    (d / "task.yaml").write_text(yaml)
    (d / "solution.sh").write_text("#!/bin/bash\nset -e\n" + spec.solution)
    (d / "run-tests.sh").write_text(RUN_TESTS)
    (d / "tests" / "test_outputs.py").write_text(TEST_HEADER + spec.tests)
    for name in ("solution.sh", "run-tests.sh"):
        (d / name).chmod(0o755)
    if spec.setup is not None:
        (d / "setup.sh").write_text("#!/bin/bash\n" + spec.setup)
    if spec.files:
        for rel, body in spec.files.items():
            f = d / "environment" / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(body if isinstance(body, bytes) else body.encode())
            f.chmod(spec.modes.get(rel, 0o644))
    return d


def generate(
    out: str | Path,
    n: int,
    seed: int = 0,
    families: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
    *,
    fold: int | None = None,
    folds: int = 0,
) -> list[Path]:
    """Write ``n`` tasks into ``out`` (created if missing), cycling through ``families``, and their splits and
    content keys into ``out/split.json`` (merged with the entries already there); ``progress(k)`` after each
    task (k tasks written so far). With ``fold`` (of ``folds``), each task's split is that fold's
    (``split.split_of``), and a task in none of its splits is not written; nor is a train task of a
    ``contam.DECONTAMINATED`` family that overlaps a test task (``contam.contaminated``)."""
    fams = list(families or FAMILIES)
    for f in fams:
        if f not in ALL_FAMILIES:
            raise ConfigError(f"unknown task family {f!r}; known: {', '.join(ALL_FAMILIES)}")
    if n < 1:
        raise ConfigError(f"--n must be >= 1, got {n}")
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    entries: dict[str, Entry] = {}
    for k, (tid, (split, spec)) in enumerate(_specs(n, seed, fams, fold, folds).items()):
        paths.append(write_task(root, tid, spec, split=split))
        entries[tid] = (split, spec.content_key, spec.family)
        if progress is not None:
            progress(k + 1)
    write_split_json(root, entries)
    return paths
