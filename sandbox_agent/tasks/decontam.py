"""Decontamination: how much a training corpus overlaps a benchmark (e.g. synth vs Terminal-Bench).

Two signals, pure functions over loaded tasks:

- near-duplicate instructions: word ``n``-gram shingles (lowercased ``\\w+`` tokens; a text shorter than
  ``n`` words is one shingle), scored by Jaccard and by containment (shared / the corpus task's shingles);
  a pair is flagged when either reaches ``threshold``. An inverted index keeps it near-linear.
- identical test files: SHA-256 of each file under ``tests/`` (line endings and trailing whitespace
  normalised), flagged when a corpus task shares any with a benchmark task.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from sandbox_agent.tasks.task import Task, TaskFormatError, iter_task_dirs, load_task

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Overlap:
    corpus_task: str
    against_task: str
    kind: Literal["instruction", "tests"]
    jaccard: float = 0.0
    containment: float = 0.0
    shared: int = 0  # shared n-grams, or shared test files
    files: tuple[str, ...] = ()  # identical test files (corpus-relative names)


@dataclass(frozen=True)
class DecontamReport:
    corpus_tasks: int
    against_tasks: int
    ngram: int
    threshold: float
    overlaps: tuple[Overlap, ...]
    unreadable: tuple[str, ...] = field(default=())  # task dirs that failed to load, with the reason

    @property
    def flagged(self) -> tuple[str, ...]:
        return tuple(sorted({o.corpus_task for o in self.overlaps}))

    def to_json(self) -> dict:
        return {
            "corpus_tasks": self.corpus_tasks,
            "against_tasks": self.against_tasks,
            "ngram": self.ngram,
            "threshold": self.threshold,
            "flagged": list(self.flagged),
            "flagged_count": len(self.flagged),
            "overlaps": [asdict(o) for o in self.overlaps],
            "unreadable": list(self.unreadable),
        }


def shingles(text: str, n: int = 8) -> frozenset[str]:
    words = _WORD.findall(text.lower())
    if not words:
        return frozenset()
    if len(words) < n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))


def file_digest(data: bytes) -> str:
    text = data.replace(b"\r\n", b"\n")
    norm = b"\n".join(ln.rstrip() for ln in text.split(b"\n")).strip()
    return hashlib.sha256(norm).hexdigest()


def digest_test_files(task: Task) -> dict[str, str]:
    """digest -> file name (relative to tests/) for each file of the task's tests dir."""
    if not task.tests_dir.is_dir():
        return {}
    out = {}
    for f in sorted(task.tests_dir.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            out[file_digest(f.read_bytes())] = str(f.relative_to(task.tests_dir))
    return out


def instruction_overlaps(
    corpus: Iterable[tuple[str, str]], against: Iterable[tuple[str, str]], n: int = 8, threshold: float = 0.5
) -> list[Overlap]:
    """Near-duplicate (id, instruction) pairs between two collections."""
    index: dict[str, list[int]] = defaultdict(list)
    bench = [(tid, shingles(text, n)) for tid, text in against]
    for j, (_, sh) in enumerate(bench):
        for s in sh:
            index[s].append(j)
    out = []
    for tid, text in corpus:
        sh = shingles(text, n)
        counts: dict[int, int] = defaultdict(int)
        for s in sh:
            for j in index.get(s, ()):
                counts[j] += 1
        for j, shared in counts.items():
            other = bench[j][1]
            jac = shared / (len(sh) + len(other) - shared)
            con = shared / len(sh)
            if jac >= threshold or con >= threshold:
                out.append(Overlap(tid, bench[j][0], "instruction", round(jac, 4), round(con, 4), shared))
    return out


def identical_test_files(corpus: Iterable[Task], against: Iterable[Task]) -> list[Overlap]:
    by_digest: dict[str, list[str]] = defaultdict(list)
    for t in against:
        for d in digest_test_files(t):
            by_digest[d].append(t.id)
    out = []
    for t in corpus:
        hits: dict[str, list[str]] = defaultdict(list)
        for d, name in digest_test_files(t).items():
            for other in by_digest.get(d, ()):
                hits[other].append(name)
        for other, names in sorted(hits.items()):
            out.append(Overlap(t.id, other, "tests", shared=len(names), files=tuple(sorted(names))))
    return out


def _load_all(root: Path) -> tuple[list[Task], list[str]]:
    tasks, bad = [], []
    for d in iter_task_dirs(root):
        try:
            tasks.append(load_task(d))
        except TaskFormatError as exc:
            bad.append(f"{d}: {exc}")
    return tasks, bad


def decontaminate(
    corpus_dir: str | Path, against_dir: str | Path, *, n: int = 8, threshold: float = 0.5
) -> DecontamReport:
    corpus, bad_c = _load_all(Path(corpus_dir))
    against, bad_a = _load_all(Path(against_dir))
    overlaps = instruction_overlaps(
        ((t.id, t.instruction) for t in corpus), ((t.id, t.instruction) for t in against), n, threshold
    )
    overlaps += identical_test_files(corpus, against)
    overlaps.sort(key=lambda o: (o.corpus_task, o.kind, -o.jaccard, o.against_task))
    return DecontamReport(len(corpus), len(against), n, threshold, tuple(overlaps), tuple(bad_c + bad_a))
