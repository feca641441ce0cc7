"""The content-dependent families (``choresn``, ``observe``, ``chain``): the oracle resolves and doing nothing
does not, ``max_turns`` is the oracle's turn count and the agent keeps to it, doing what was not asked fails,
the split holds out keys, ``choresn``'s held-out n and ``observe``'s held-out variant, folds set the untouched
keys aside, and no train task is a near-duplicate of a test task by ``sandbox_agent decontam``'s checks."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from sandbox_agent.agent.runner import OracleAgent, check_tasks, run_episode, run_policy, solution_chunks
from sandbox_agent.agent.types import AgentConfig
from sandbox_agent.synth import corpus_entries, generate, make_task
from sandbox_agent.synth.chain import MENU as CHAIN_MENU
from sandbox_agent.synth.chores import MENU, menu_steps
from sandbox_agent.synth.choresn import HELD_OUT_N, key_of, not_asked_test, one_chore_test, oracle_turns
from sandbox_agent.synth.common import TEST_HEADER, SynthSpec
from sandbox_agent.synth.contam import KEYED, contaminated
from sandbox_agent.synth.split import UNTOUCHED_PERCENT, split_of
from sandbox_agent.tasks.decontam import file_digest, instruction_overlaps
from sandbox_agent.tasks.task import load_task
from tests.scripted_episode import ByteTok, ScriptedSampler, bash

CONTENT = ["choresn", "observe", "chain"]


async def test_oracle_resolves_and_doing_nothing_does_not(tmp_path):
    paths = generate(tmp_path, 9, seed=3, families=CONTENT)
    assert sorted(Counter(load_task(p).family for p in paths).values()) == [3, 3, 3]
    rows = await check_tasks([load_task(p) for p in paths], concurrency=3)
    bad = {r.task_id: (r.oracle.passed, r.oracle.total, r.null.passed) for r in rows if not r.ok}
    assert bad == {}
    assert all(r.oracle.total >= 3 for r in rows)


def test_max_turns_is_the_oracles_turn_count(tmp_path):
    seen_n = set()
    for fam in CONTENT:
        for i in range(40):
            _, spec = make_task(fam, 0, i)
            turns = len(solution_chunks(spec.solution)) + 1  # the chunks, then DONE
            assert spec.max_turns == turns, (fam, i)
            if fam == "choresn":
                n = spec.instruction.count("\n")
                seen_n.add(n)
                assert spec.max_turns == oracle_turns(n) == math.ceil(n / 2) + 1
                assert spec.content_key.startswith(f"choresn:n{n}:")
            if fam == "chain":
                assert 8 <= spec.instruction.count("\n") <= 12 and spec.max_turns >= 9
    assert seen_n == {2, 3, 4, 5, 6}
    t = load_task(generate(tmp_path, 1, seed=0, families=["chain"])[0])
    assert t.extra["max_turns"] == len(solution_chunks(t.solution.read_text())) + 1


def _task_of(tmp_path, family: str, want) -> object:
    for i in range(200):
        tid, spec = make_task(family, 0, i)
        if want(spec):
            from sandbox_agent.synth import write_task

            return load_task(write_task(tmp_path, tid, spec, split="train"))
    raise AssertionError(f"no {family} task matched")


async def test_the_agent_gets_the_tasks_turns_and_a_chore_not_asked_fails(tmp_path):
    task = _task_of(tmp_path, "choresn", lambda s: s.instruction.count("\n") == 3)  # 3 chores: 2 replies + DONE
    asked = [i for i, m in enumerate(MENU) if m[0] in task.instruction]
    extra = next(i for i in range(len(MENU)) if i not in asked)
    oracle = [bash(c) for c in solution_chunks(task.solution.read_text())]
    tok = ByteTok()
    cfg = AgentConfig(max_turns=20, verify_every=0)
    ok = await run_episode(task, sampler=ScriptedSampler(tok, [*oracle, "DONE"]), tokenizer=tok, config=cfg)
    assert ok.resolved and ok.turns == 3
    # one reply more than the oracle, of a chore not asked: the task's max_turns (3) ends it there, and fails
    over = await run_episode(
        task, sampler=ScriptedSampler(tok, [*oracle, bash(MENU[extra][1]), "DONE"]), tokenizer=tok, config=cfg
    )
    assert over.turns == 3 and over.reason == "max_turns"
    assert not over.resolved and over.tests_passed == over.tests_total - 1  # test_not_asked


class _Blind(OracleAgent):
    """The oracle with the name it read replaced by another: a policy that does not read the observation."""

    name = "blind"

    def __init__(self, wrong: str, right: str) -> None:
        self.wrong, self.right = wrong, right

    async def act(self, task, sandbox):
        script = task.solution.read_text().replace(self.right, self.wrong)
        return await sandbox.exec(script, timeout=60)


async def test_observe_acting_on_another_name_fails(tmp_path):
    for variant in ("mkdir", "rm", "ls"):
        task = _task_of(tmp_path / variant, "observe", lambda s, v=variant: s.content_key.startswith(f"observe:{v}:"))
        right = task.content_key.split(":")[2]
        run = await run_policy(task, _Blind("zzz9", right))
        assert run.verify.status == "ok" and not run.verify.resolved, (variant, run.verify)
        assert run.verify.passed < run.verify.total


async def test_chain_doing_one_more_chore_fails(tmp_path):
    task = _task_of(tmp_path, "chain", lambda s: s.instruction.count("\n") == 8)
    extra = next(m for m in CHAIN_MENU if m[0] not in task.instruction)

    class Plus(OracleAgent):
        async def act(self, t, sandbox):
            await super().act(t, sandbox)
            return await sandbox.exec(extra[1], timeout=60)

    run = await run_policy(task, Plus())
    assert not run.verify.resolved and run.verify.passed == run.verify.total - 1


def test_split_holds_out_keys_the_held_out_n_and_the_ls_variant():
    entries = corpus_entries(600, 0, CONTENT)
    by_split: dict[str, set[str]] = {}
    for split, key, _ in entries.values():
        by_split.setdefault(split, set()).add(key)
        if key.startswith(f"choresn:n{HELD_OUT_N}:") or key.startswith("observe:ls:"):
            assert split == "test", key
    assert set(by_split) == {"train", "eval", "test"}
    assert not (by_split["train"] & by_split["test"]) and not (by_split["train"] & by_split["eval"])
    ns = {int(k.split(":")[1][1:]) for k in by_split["train"] if k.startswith("choresn:")}
    assert ns == {2, 3, 4, 6}
    assert any(k.startswith(f"choresn:n{HELD_OUT_N}:") for k in by_split["test"])


def test_folds_salt_the_split_and_keep_the_untouched_keys_out_of_every_other_fold():
    keys = [f"choresn:n3:{i}" for i in range(3000)]
    folds = 3
    untouched = {k for k in keys if split_of(k, fold=folds, folds=folds) == "test"}
    assert abs(len(untouched) / len(keys) - UNTOUCHED_PERCENT / 100) < 0.03
    tests = []
    for f in range(folds):
        s = {k: split_of(k, fold=f, folds=folds) for k in keys}
        assert {k for k, v in s.items() if v is None} == untouched  # in no split of folds 0..2
        tests.append({k for k, v in s.items() if v == "test"})
    assert tests[0] != tests[1] != tests[2]  # salted: each fold holds out its own keys
    assert all(abs(len(t) / len(keys) - 0.09) < 0.03 for t in tests)
    ood = [f"choresn:n5:{i}" for i in range(300)]
    assert {split_of(k, fold=0, folds=folds) for k in ood} == {"test", None}  # None: set aside for the untouched
    assert {k for k in ood if split_of(k, fold=folds, folds=folds) == "test"} == {
        k for k in ood if split_of(k, fold=0, folds=folds) is None
    }  # the untouched fold tests only keys no other fold read, OOD ones too
    assert split_of("chores:0+1+2+3") == split_of("chores:0+1+2+3", fold=None)  # no fold: the old split
    with pytest.raises(Exception, match="fold 4 of 3"):
        split_of("x", fold=4, folds=3)


def test_no_train_task_is_a_near_duplicate_of_a_test_task():
    specs = dict(make_task(CONTENT[i % 3], 0, i) for i in range(900))  # the corpus's tasks, before dropping
    entries = corpus_entries(900, 0, CONTENT)
    dropped = [t for t, s in specs.items() if t not in entries and split_of(s.content_key) == "train"]
    assert dropped  # a choresn train task that asks for all a test task asks (its chores, first): dropped
    train = {t: specs[t] for t, e in entries.items() if e[0] == "train"}
    test = {t: specs[t] for t, e in entries.items() if e[0] == "test"}
    assert not {s.content_key for s in train.values()} & {s.content_key for s in test.values()}
    worded = [(t, s.instruction) for t, s in train.items() if s.family == "chain"]
    against = [(t, s.instruction) for t, s in test.items() if s.family != "observe"]
    assert worded and instruction_overlaps(worded, against) == []  # sandbox_agent decontam's check, both ways
    keyed = [(t, s.instruction) for t, s in train.items() if s.family in KEYED]
    assert keyed and not [o for o in instruction_overlaps(against, keyed) if o.containment >= 1.0]
    test_digests = {file_digest((TEST_HEADER + s.tests).encode()) for s in test.values()}
    assert not any(file_digest((TEST_HEADER + s.tests).encode()) in test_digests for s in train.values())
    # and the check itself flags a train task worded as a test task, and only against a test task
    a = make_task("choresn", 0, 0)[1]
    assert "content key of y" in contaminated({"x": a}, {"y": a})["x"] and contaminated({"x": a}, {}) == {}
    c = make_task("chain", 0, 2)[1]
    assert "instruction of y" in contaminated({"x": c}, {"y": replace(c, content_key="other")})["x"]


def _chores(family: str, picked: list[int]) -> SynthSpec:
    """A ``choresn`` task asking for ``picked``, in that order (as ``choresn._choresn`` writes it)."""
    others = [i for i in range(len(MENU)) if i not in picked]
    tests = "".join(one_chore_test(k, i) for k, i in enumerate(picked)) + not_asked_test(others)
    instr = f"In the current directory:\n{menu_steps(picked)}"
    return SynthSpec(family, instr, "", tests, content_key=key_of(len(picked), picked))


def test_choresn_decontamination_is_by_key_and_whole_test_instructions():
    test = {"t5": _chores("choresn", [2, 7, 4, 3, 6])}
    # a two-chore train task starting as the five-chore test task does (another key): the 8-gram check in the
    # train -> test direction called it contained (1.00) and dropped it; it asks for less than the test task
    assert contaminated({"p": _chores("choresnsome", [2, 7])}, test) == {}
    # one sharing only its first chore (and the header) with a test task: 0.62 before, dropped too
    assert contaminated({"q": _chores("choresnsome", [4, 8])}, {"t": _chores("choresn", [4, 3, 1, 5, 8])}) == {}
    # the test task's chore set in another order: its key, dropped (the old check kept it)
    assert "content key of t5" in contaminated({"r": _chores("choresnsome", [6, 3, 4, 7, 2])}, test)["r"]
    # a train task asking for all the test task asks, and one more: dropped (the old check kept it)
    two = {"t2": _chores("choresn", [2, 7])}
    got = contaminated({"w": _chores("choresnsome", [2, 7, 4, 1])}, two)
    assert "contains all of t2" in got["w"]
