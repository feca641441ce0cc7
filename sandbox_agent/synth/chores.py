"""``chores``: the ``learn`` preset's family. Four chores from a fixed menu of nine, in random order, done in two
replies (two chores each); one test per requested chore, which also checks that an unrequested chore was NOT
done (doing the whole menu fails every test).

Every chore has fixed arguments ("create the directory build" is always ``mkdir -p build``), so the policy maps
instruction phrases to commands: no name is copied from the instruction. A few-million-parameter MoE trained
from random weights did not learn to copy names in the time a 2-core warm start has (the ``mkfile``/``copy``
families: docs/results.md, "Learning"), while a phrase -> command lookup is learnt in minutes.

The tests check only the final state, so the order of the four is no part of the task: there are only
C(9, 4) = 126 distinct tasks (the 3024 ordered picks are 24 wordings of each). The content key is the chore
*set* (``chores:<menu indices, sorted>``), and the split holds out whole sets: an eval or test task's four
chores never appear together in a training task, in any order.

``choresome``: the same tasks, but a weaker demonstrator's oracle: it does only the first k of the four (k in
1-4, ``SOME_WEIGHTS``), and its task tests those k. The ``learn`` warm start imitates it. A warm start trained
on the full oracle resolved every held-out chore set, greedily and at temperature 1 (docs/results.md,
"Learning"): nothing was left for RL. This one knows each chore's command but stops early as its demonstrator
did, so RL on ``chores`` (all four tested) has a multi-turn decision to fix: go on after the first reply, on
chore sets it has never seen. Both share one content key space.
"""

from __future__ import annotations

import random

from sandbox_agent.synth.common import SynthSpec

# (instruction phrase, command, python check that it was done, python check that it was not)
MENU: tuple[tuple[str, str, str, str], ...] = (
    ("create the directory build", "mkdir -p build", '(WORK / "build").is_dir()', 'not (WORK / "build").exists()'),
    ("delete the file old.log", "rm -f old.log", 'not (WORK / "old.log").exists()', '(WORK / "old.log").exists()'),
    (
        "make run.sh executable",
        "chmod +x run.sh",
        'os.access(WORK / "run.sh", os.X_OK)',
        'not os.access(WORK / "run.sh", os.X_OK)',
    ),
    (
        "write hello into greeting.txt",
        "echo hello > greeting.txt",
        'read("greeting.txt").strip() == "hello"',
        'not (WORK / "greeting.txt").exists()',
    ),
    (
        "copy notes.txt to backup.txt",
        "cp notes.txt backup.txt",
        'read("backup.txt") == read("notes.txt")',
        'not (WORK / "backup.txt").exists()',
    ),
    (
        "rename draft.md to final.md",
        "mv draft.md final.md",
        '(WORK / "final.md").is_file() and not (WORK / "draft.md").exists()',
        '(WORK / "draft.md").is_file()',
    ),
    (
        "append done to todo.txt",
        "echo done >> todo.txt",
        'lines("todo.txt")[-1] == "done"',
        'lines("todo.txt")[-1] != "done"',
    ),
    (
        "create the empty file ready.flag",
        "touch ready.flag",
        '(WORK / "ready.flag").is_file()',
        'not (WORK / "ready.flag").exists()',
    ),
    (
        "write the number of lines of data.csv into count.txt",
        "wc -l < data.csv > count.txt",
        'read("count.txt").strip() == "4"',
        'not (WORK / "count.txt").exists()',
    ),
)
FILES: dict[str, str] = {
    "old.log": "started\nstopped\n",
    "run.sh": "#!/bin/bash\necho running\n",
    "notes.txt": "buy milk\ncall bob\n",
    "draft.md": "# draft\n",
    "todo.txt": "write report\nfix bug\n",
    "data.csv": "id,name\n1,ada\n2,bob\n3,eve\n",
}


# how many of the four chores ``choresome``'s demonstrator does, and how often: 1, 2, 3 or 4 in 1:4:1:2. After
# the first reply of two chores, stopping (4 in 7) is likelier than going on, so its imitator decoded greedily
# mostly stops there: the learn warm start resolved 13% of held-out eval tasks greedily and 0% of test ones
# (1.98 tests of 4), 19% of eval tasks at temperature 1, where its demonstrator resolves 2 in 8
SOME_WEIGHTS = (1, 4, 1, 2)


def menu_steps(picked: list[int]) -> str:
    """The instruction's numbered list of the picked chores' phrases."""
    last = len(picked) - 1
    return "\n".join(f"{k + 1}. {MENU[i][0]}{'.' if k == last else ';'}" for k, i in enumerate(picked))


def demonstrated(
    rng: random.Random, picked: list[int], *, all_four: bool, weights: tuple[int, ...] = SOME_WEIGHTS
) -> list[int]:
    """The chores the demonstrator does: all four, or (the weaker one) the first k, k = 1, 2, ... drawn by
    ``weights``."""
    return picked if all_four else picked[: rng.choices(range(1, len(weights) + 1), weights=weights)[0]]


def chore_replies(done: list[int]) -> str:
    """The oracle's chore commands, two a reply (replies split by a blank line); the last holds what is left."""
    return "\n\n".join("\n".join(MENU[i][1] for i in done[j : j + 2]) for j in range(0, len(done), 2)) + "\n"


def chore_test(k: int, i: int, undone: str) -> str:
    """The test of the ``k``-th requested chore, menu item ``i``: done, and ``undone`` (an expression: the
    unrequested chores it checks) still holds."""
    return f"""

def test_chore_{k + 1}():
    assert {MENU[i][2]}, "not done: {MENU[i][0]}"
    assert {undone}, "done although not asked"
"""


def chores_family(rng: random.Random) -> SynthSpec:
    return _chores(rng, "chores", all_four=True)


def choresome_family(rng: random.Random) -> SynthSpec:
    return _chores(rng, "choresome", all_four=False)


def _chores(rng: random.Random, family: str, *, all_four: bool) -> SynthSpec:
    picked = rng.sample(range(len(MENU)), 4)
    others = [i for i in range(len(MENU)) if i not in picked]
    rng.shuffle(others)
    steps = menu_steps(picked)
    instr = f"In the current directory:\n{steps}"
    key = "chores:" + "+".join(str(i) for i in sorted(picked))
    done = demonstrated(rng, picked, all_four=all_four)
    sol = chore_replies(done)  # then DONE
    # 5 unrequested chores over 4 tests
    tests = "".join(chore_test(k, i, " and ".join(f"({MENU[j][3]})" for j in others[k::4])) for k, i in enumerate(done))
    return SynthSpec(family, instr, sol, tests, files=dict(FILES), tags=("menu",), content_key=key)


def chores6_family(rng: random.Random) -> SynthSpec:
    """Six chores of the menu in three replies: out of distribution for a policy trained on ``chores``, by
    recombination only. Every phrase and command is the menu's, worded as in ``chores``; what is new is the
    number, so a policy that learned "go on after the first reply" must go on once more. One test per chore,
    each also checking that one of the three unrequested chores was not done. Its own content key space
    (``chores6:<set>``): no RL or SFT task is of this family."""
    picked = rng.sample(range(len(MENU)), 6)
    others = [i for i in range(len(MENU)) if i not in picked]
    rng.shuffle(others)
    instr = f"In the current directory:\n{menu_steps(picked)}"
    key = "chores6:" + "+".join(str(i) for i in sorted(picked))
    tests = "".join(chore_test(k, i, MENU[others[k % 3]][3]) for k, i in enumerate(picked))
    return SynthSpec(
        "chores6", instr, chore_replies(picked), tests, files=dict(FILES), tags=("menu", "ood"), content_key=key
    )
