"""The corpus split by content: a regenerated corpus (and the warm start's SFT corpus) never has one task's
content in two splits. The content is read back from the written task files here, by code of its own (the
chore set from the instruction, the file names asked for, a digest of the tests and inputs), never from the
``content_key`` or ``split`` the generator wrote, so a generator that split by anything else fails."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from sandbox_agent.synth import corpus_entries, generate, make_task
from sandbox_agent.synth.chores import MENU
from sandbox_agent.synth.split import SPLIT_FILE, leaks, read_split_json
from sandbox_agent.tasks.task import load_task, split_for
from t1async.protocol.errors import ConfigError

PHRASES = {m[0]: i for i, m in enumerate(MENU)}


def chore_phrases(instruction: str) -> list[str]:
    """The menu phrases a chores (or choresome) instruction lists, in its order."""
    steps = re.findall(r"^\d\. (.+?)[;.]$", instruction, re.M)
    assert len(steps) == 4 and all(s in PHRASES for s in steps), instruction
    return steps


def content_of(d: Path) -> str:
    """What the task asks for, read from its files: chores/choresome -> the set of menu phrases in the instruction
    (their order is no part of the task), touch4/touchsome -> the set of file names, others -> a digest of the
    tests, the input files and setup.sh."""
    t = load_task(d)
    if t.family in ("chores", "choresome"):
        return "chores " + " | ".join(sorted(chore_phrases(t.instruction)))
    if t.family in ("touch4", "touchsome"):
        return "touch " + " ".join(sorted(re.findall(r"(\w+)\.txt", t.instruction)))
    h = hashlib.sha256((d / "tests" / "test_outputs.py").read_bytes())
    for f in sorted((d / "environment").rglob("*")) if (d / "environment").is_dir() else []:
        if f.is_file():
            h.update(str(f.relative_to(d)).encode() + f.read_bytes())
    if (d / "setup.sh").is_file():
        h.update((d / "setup.sh").read_bytes())
    return f"{t.family} {h.hexdigest()}"


def split_of(d: Path) -> str:
    return load_task(d).split


def corpus(root: Path, n: int, seed: int, families: list[str]) -> list[Path]:
    return generate(root, n, seed=seed, families=families)


@pytest.fixture(scope="module")
def bench_and_sft(tmp_path_factory):
    """The learn bench's corpus (chores, seed 0) and the learn warm start's (chores, seed 1000, 400 tasks), plus
    a mixed corpus of the other families."""
    root = tmp_path_factory.mktemp("split")
    return {
        "bench": corpus(root / "bench", 600, 0, ["chores"]),
        "sft": corpus(root / "sft", 400, 1000, ["chores"]),
        "mixed": corpus(root / "mixed", 120, 3, ["touch4", "mkfile", "copy", "text", "perms", "git"]),
        "touchsome": corpus(root / "touchsome", 200, 2002, ["touchsome"]),
        "learn_sft": corpus(root / "learn_sft", 400, 1000, ["choresome"]),  # the learn warm start's demos
    }


def test_regenerated_corpora_are_disjoint_by_content(bench_and_sft):
    bench, sft = bench_and_sft["bench"], bench_and_sft["sft"]
    pairs = [(split_of(d), content_of(d)) for d in bench]
    # the SFT corpus gives only its train split as demonstrations: none of them may be a held-out content
    pairs += [("train", content_of(d)) for d in sft + bench_and_sft["learn_sft"] if split_of(d) == "train"]
    assert leaks(pairs) == {}
    held = {c for s, c in pairs if s in ("eval", "test")}
    assert len(held) >= 10  # something is held out at all: eval and test keys of the 126 chore sets
    splits = Counter(s for s, _ in pairs[: len(bench)])
    assert splits["eval"] > 0 and splits["test"] > 0 and splits["train"] > splits["eval"] + splits["test"]
    mixed = [(split_of(d), content_of(d)) for d in bench_and_sft["mixed"] + bench_and_sft["touchsome"]]
    assert leaks(mixed) == {}


def test_the_check_catches_a_split_by_task_id(bench_and_sft):
    """The old split (a hash of the task id) put the same chore set in train and in eval: the check sees it."""

    def by_id(tid: str) -> str:
        h = int.from_bytes(hashlib.sha256(tid.encode()).digest()[:8], "big")
        return "eval" if h % 100 < 10 else "train"

    pairs = [(by_id(load_task(d).id), content_of(d)) for d in bench_and_sft["bench"]]
    found = leaks(pairs)
    assert len(found) > 10 and all(v == ["eval", "train"] for v in found.values())


def test_split_json_lists_every_task_with_its_split_and_key(bench_and_sft):
    paths = bench_and_sft["mixed"]
    table = read_split_json(paths[0].parent)
    assert sorted(table) == sorted(p.name for p in paths)
    for p in paths:
        t = load_task(p)
        assert table[t.id] == {"split": t.split, "content_key": t.content_key, "family": t.family}
        assert t.split == split_for(t.content_key)
    # and corpus_entries, which writes nothing, agrees with what generate wrote
    got = corpus_entries(120, 3, ["touch4", "mkfile", "copy", "text", "perms", "git"])
    assert {k: list(v) for k, v in got.items()} == {
        k: [v["split"], v["content_key"], v["family"]] for k, v in table.items()
    }


def test_chores_has_126_distinct_tasks_whatever_the_order():
    keys = {make_task("chores", 0, i)[1].content_key for i in range(3000)}
    assert len(keys) == 126  # C(9, 4): the order of the four chores is no part of the task
    for fam in ("touch4", "touchsome"):  # one key space: the names asked for, though touchsome tests fewer
        for i in range(20):
            spec = make_task(fam, 0, i)[1]
            assert spec.content_key == "touch:" + ",".join(sorted(re.findall(r"(\w+)\.txt", spec.instruction)))
    for i in range(20):  # choresome asks for the same four chores as chores, and tests only those it does
        some = make_task("choresome", 0, i)[1]
        menu = sorted(PHRASES[s] for s in chore_phrases(some.instruction))
        assert some.content_key == "chores:" + "+".join(str(j) for j in menu)


def test_split_json_of_another_version_is_refused(tmp_path):
    (tmp_path / SPLIT_FILE).write_text(json.dumps({"version": "id-hash", "tasks": {}}))
    with pytest.raises(ConfigError, match="regenerate the corpus"):
        read_split_json(tmp_path)
    generate(tmp_path, 2, seed=0, families=["chores"])  # regenerating replaces it
    assert len(read_split_json(tmp_path)) == 2


def test_sft_demonstrates_only_the_train_split(tmp_path, monkeypatch):
    """`python -m t1async.learner sft --tasks DIR` took every task of DIR, eval and test ones too (seen failing
    on the old code): now only the train split reaches collect_demos, and a dir without one is refused."""
    from t1async.learner.settings import SFTConfig
    from t1async.recipes import sft

    paths = generate(tmp_path / "tasks", 40, seed=0, families=["chores"])
    got: list = []

    async def fake_collect(tasks, concurrency=2):
        got.extend(tasks)
        return []

    monkeypatch.setattr(sft, "collect_demos", fake_collect)
    with pytest.raises(ConfigError, match="gave a resolved oracle demonstration"):
        sft.run_sft(SFTConfig(steps=1, out=tmp_path / "out", tasks=tmp_path / "tasks"))
    splits = Counter(load_task(p).split for p in paths)
    assert splits["eval"] + splits["test"] > 0 and len(got) == splits["train"]
    assert {t.split for t in got} == {"train"}
    held = tmp_path / "held"
    held.mkdir()
    for p in paths:
        if load_task(p).split != "train":
            p.rename(held / p.name)
    with pytest.raises(ConfigError, match="held out of SFT"):
        sft.run_sft(SFTConfig(steps=1, out=tmp_path / "out2", tasks=held))


def test_choresome_demonstrator_mostly_stops_after_its_first_reply():
    """The learn warm start imitates it: so that its greedy decoding stops early (and RL has something to teach
    on chore sets it never saw), stopping after the first reply of two chores must be the likelier choice."""
    from sandbox_agent.agent.runner import solution_chunks

    ks = Counter(make_task("choresome", 0, i)[1].tests.count("def test_chore_") for i in range(800))
    assert set(ks) == {1, 2, 3, 4}
    assert ks[2] > ks[3] + ks[4] and ks[4] > ks[3]
    for i in range(40):
        spec = make_task("choresome", 0, i)[1]
        k = spec.tests.count("def test_chore_")
        replies = solution_chunks(spec.solution)  # as the oracle's turns run them
        assert [len(r.splitlines()) for r in replies] == [min(k, 2)] + ([k - 2] if k > 2 else [])


def test_chores6_is_the_menu_six_at_a_time_in_three_replies_and_its_oracle_resolves(tmp_path):
    """bench.learning's recombination OOD family: the chores phrasing and commands, six of them, so a policy
    trained on four in two replies must go on for a third. Its keys are its own, never a ``chores`` key."""
    import anyio

    from sandbox_agent.agent.runner import check_tasks, solution_chunks

    for i in range(40):
        spec = make_task("chores6", 0, i)[1]
        lines = spec.instruction.splitlines()
        assert lines[0] == "In the current directory:" and len(lines) == 7 and lines[-1].endswith(".")
        assert {ln.split(". ", 1)[1].rstrip(";.") for ln in lines[1:]} <= {m[0] for m in MENU}
        assert [len(r.splitlines()) for r in solution_chunks(spec.solution)] == [2, 2, 2]
        assert spec.content_key.startswith("chores6:") and spec.tests.count("def test_chore_") == 6
    paths = generate(tmp_path, 6, seed=4, families=["chores6"])
    rows = anyio.run(lambda: check_tasks([load_task(q) for q in paths], concurrency=3))
    assert {r.task_id: (r.ok, r.oracle.total, r.null.passed) for r in rows} == {r.task_id: (True, 6, 0) for r in rows}
