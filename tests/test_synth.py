"""The synthetic corpus: every family's oracle resolves its tasks in the real sandbox, doing nothing never
does, generation is deterministic, and families x seeds give thousands of distinct tasks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sandbox_agent.agent.runner import check_tasks
from sandbox_agent.synth import FAMILIES, generate, make_task
from sandbox_agent.tasks.task import load_task, split_for
from t1async.protocol.errors import ConfigError


async def _check_corpus(paths: list[Path]) -> dict[str, str]:
    """Run oracle and null on every task (a few at a time); return {task: what went wrong}."""
    rows = await check_tasks([load_task(p) for p in paths], concurrency=3)
    problems = {}
    for r in rows:
        o, n = r.oracle, r.null
        if not (r.ok and o.passed == o.total >= 3 and n.total >= 3):
            problems[r.task_id] = (
                f"oracle {o.status} {o.passed}/{o.total} {o.detail[-800:]}; null {n.status} {n.passed}/{n.total}"
            )
    return problems


async def test_every_family_oracle_resolves_and_null_does_not(tmp_path):
    paths = generate(tmp_path, len(FAMILIES), seed=0)
    assert sorted(load_task(p).family for p in paths) == sorted(FAMILIES)
    assert await _check_corpus(paths) == {}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_more_seeds_oracle_resolves_and_null_does_not(tmp_path, seed):
    paths = generate(tmp_path, 2 * len(FAMILIES), seed=seed)
    assert await _check_corpus(paths) == {}


def test_written_tasks_are_well_formed(tmp_path):
    paths = generate(tmp_path, 2 * len(FAMILIES), seed=5)
    for p in paths:
        t = load_task(p)
        assert t.format == "tb1" and t.split == split_for(t.content_key) and t.family in FAMILIES
        assert t.solution is not None and t.test_files == ("test_outputs.py",) and t.docker_image is None
        assert (t.tests_dir / "test_outputs.py").read_text().count("\ndef test_") >= 3
        assert (p / "run-tests.sh").stat().st_mode & 0o100
        assert len(t.instruction) > 80


def test_generation_is_deterministic(tmp_path):
    a = generate(tmp_path / "a", 22, seed=9)
    b = generate(tmp_path / "b", 22, seed=9)

    def digest(root: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(root.rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(root)).encode() + f.read_bytes() + oct(f.stat().st_mode & 0o777).encode())
        return h.hexdigest()

    assert [p.name for p in a] == [p.name for p in b]
    assert all(digest(x) == digest(y) for x, y in zip(a, b))
    c = generate(tmp_path / "c", 22, seed=10)
    assert digest(a[0]) != digest(c[0])


def test_families_times_seeds_give_thousands_of_distinct_tasks():
    seen: dict[str, set[str]] = {f: set() for f in FAMILIES}
    for fam in FAMILIES:
        for i in range(300):
            _, spec = make_task(fam, 0, i)
            seen[fam].add(hashlib.sha256((spec.instruction + spec.tests).encode()).hexdigest())
    assert all(len(s) >= 290 for s in seen.values()), {f: len(s) for f, s in seen.items()}
    assert sum(len(s) for s in seen.values()) >= 3000


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="unknown task family 'nope'"):
        generate(tmp_path, 3, families=["nope"])
    with pytest.raises(ConfigError, match="--n must be >= 1"):
        generate(tmp_path, 0)
