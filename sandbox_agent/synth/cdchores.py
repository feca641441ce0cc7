"""``cdchores``: a family where multi-turn credit matters. The ``chores`` menu, done inside one of four sibling
directories that all hold the same files; the instruction names the directory ("In the directory site:").

The oracle takes three commands in three turns: ``cd site`` first, then two chores, then two more. The ``cd``
makes no test pass by itself (every test checks the files inside the directory), so a per-command dense reward
gives it 0, yet without it every later chore lands in the wrong place and fails. That is the T1 setting: a
setup step whose value shows only in later turns' rewards (or, with ``--reward binary``, only at the end).

Each of the four tests checks one requested chore was done in the named directory, that unrequested chores
were not done there, and that this chore was not done in the three other directories (doing it everywhere
fails). No name is copied from the instruction: the directory is one of four fixed words and the chores are
the ``chores`` menu, so a small model can learn it (as ``chores``, whose phrases it shares).

What makes two tasks the same task is the directory and the chore *set* (tests check only the final state, so
order does not matter): ``content_key`` gives it, 4 x C(9,4) = 504 distinct tasks, and the split holds out whole
keys.

``cdchoresome``: the same tasks by a weaker demonstrator, as ``choresome`` is to ``chores``: it does the ``cd``
and then only the first k of the four chores (k in 1-4, ``chores.SOME_WEIGHTS``), and its task tests those k.
The ``credit`` warm start imitates it, so that it resolves some tasks, and a binary reward has a signal to
learn from at all (a warm start on the full oracle resolved none of the held-out ones, docs/results.md).

``cdchoresfew``: a demonstrator that never does all four (k in 1-3, ``FEW_WEIGHTS``). The ``credit-rare`` warm
start imitates it: every chore's command is in its demonstrations, but no episode of them resolves its
``cdchores`` task, so a binary reward is 0 unless the policy goes beyond what it was shown, while a dense one
pays for each chore (T1's setting, where a whole success is rare).
"""

from __future__ import annotations

import random

from sandbox_agent.synth.chores import FILES, MENU, SOME_WEIGHTS, chore_replies, demonstrated, menu_steps
from sandbox_agent.synth.common import SynthSpec

DIRS: tuple[str, ...] = ("app", "site", "work", "srv")
# ``cdchoresfew``'s demonstrator: the first k chores, k = 1, 2, 3 (never all four)
FEW_WEIGHTS = (1, 4, 2)


def _draw(rng: random.Random) -> tuple[str, list[int], list[int]]:
    """The drawn parameters: (directory, the four chores in order, the five others in test order)."""
    target = rng.choice(DIRS)
    picked = rng.sample(range(len(MENU)), 4)
    others = [i for i in range(len(MENU)) if i not in picked]
    rng.shuffle(others)
    return target, picked, others


def content_key(rng: random.Random) -> str:
    """What makes two ``cdchores`` tasks the same task, from the rng the generator is given (the same
    ``random.Random`` state gives the same draw): the directory and the sorted chore set, e.g.
    ``"cdchores:site:0,2,5,8"``."""
    target, picked, _ = _draw(rng)
    return _key(target, picked)


def _key(target: str, picked: list[int]) -> str:
    return f"cdchores:{target}:" + ",".join(str(i) for i in sorted(picked))


def cdchores_family(rng: random.Random) -> SynthSpec:
    return _cdchores(rng, "cdchores", all_four=True)


def cdchoresome_family(rng: random.Random) -> SynthSpec:
    return _cdchores(rng, "cdchoresome", all_four=False)


def cdchoresfew_family(rng: random.Random) -> SynthSpec:
    return _cdchores(rng, "cdchoresfew", all_four=False, weights=FEW_WEIGHTS)


def _cdchores(rng: random.Random, family: str, *, all_four: bool, weights: tuple[int, ...] = SOME_WEIGHTS) -> SynthSpec:
    target, picked, others = _draw(rng)
    decoys = [d for d in DIRS if d != target]
    steps = menu_steps(picked)
    instr = f"In the directory {target}:\n{steps}"
    done = demonstrated(rng, picked, all_four=all_four, weights=weights)
    sol = f"cd {target}\n\n" + chore_replies(done)  # the cd, then the chores two a reply
    # the menu's checks name WORK, read() and lines(): `at` evaluates one with WORK rebound to a directory
    tests = f'''
TOP = WORK
TARGET = {target!r}
DECOYS = {decoys!r}


def at(d, check):
    """Evaluate ``check`` (a menu check naming WORK) inside directory ``d``."""
    global WORK
    WORK = TOP / d
    try:
        return check()
    finally:
        WORK = TOP
'''
    for k, i in enumerate(done):
        undone = " and ".join(f"({MENU[j][3]})" for j in others[k::4])  # 5 unrequested chores over 4 tests
        tests += f"""

def test_chore_{k + 1}():
    assert at(TARGET, lambda: {MENU[i][2]}), "not done in {target}: {MENU[i][0]}"
    assert at(TARGET, lambda: {undone}), "done in {target} although not asked"
    for d in DECOYS:
        assert at(d, lambda: {MENU[i][3]}), f"done in {{d}}, not only in {target}: {MENU[i][0]}"
"""
    files: dict[str, str | bytes] = {f"{d}/{name}": body for d in DIRS for name, body in FILES.items()}
    return SynthSpec(
        family, instr, sol, tests, files=files, tags=("menu", "setup-step"), content_key=_key(target, picked)
    )
