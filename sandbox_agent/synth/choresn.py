"""``choresn``: the ``chores`` menu, but the number of chores asked varies, n in {2, ..., 6}, so when to stop
depends on what was asked (``chores`` always asks four: "always send a second reply" was all RL had to learn).

The oracle does two chores a reply, ``ceil(n / 2)`` replies, then DONE; the task's ``max_turns`` is exactly
that (``SynthSpec.max_turns``: ``ceil(n / 2) + 1``), so a reply more is not free: the only extra reply there is
room for is a chore that was not asked, which fails ``test_not_asked`` (it checks every unrequested chore of
the menu is undone). One test per requested chore, plus ``test_not_asked``: n + 1 >= 3 tests.

The content key is n and the chore set (``choresn:n<n>:<menu indices, sorted>``). The split holds out keys
(``split.split_of``) and, for OOD, one value of n whole: every task with ``n == HELD_OUT_N`` is a test task
(``OOD_PREFIXES``), so no train or eval task asks for five chores, and a policy that counts must interpolate.

``choresnsome``: the same tasks by a weaker demonstrator that stops after k of the ``ceil(n / 2)`` replies, k
uniform, whatever n is: its imitator knows every command, and when to stop is left for RL to learn from what
the instruction asks. Its tasks test what it did, so its demonstrations resolve them.
"""

from __future__ import annotations

import math
import random

from sandbox_agent.synth.chores import FILES, MENU, chore_replies, menu_steps
from sandbox_agent.synth.common import SynthSpec

N_VALUES: tuple[int, ...] = (2, 3, 4, 5, 6)
HELD_OUT_N = 5  # OOD: never a train or eval task (split.OOD_PREFIXES)
OOD_PREFIX = f"choresn:n{HELD_OUT_N}:"


def oracle_turns(n: int) -> int:
    """Turns the oracle takes for n chores: two a reply, then DONE."""
    return math.ceil(n / 2) + 1


def not_asked_test(others: list[int]) -> str:
    """``test_not_asked``: none of the unrequested menu chores was done."""
    body = "\n".join(f'    assert {MENU[j][3]}, "done although not asked: {MENU[j][0]}"' for j in others)
    return f"\n\ndef test_not_asked():\n{body}\n"


def one_chore_test(k: int, i: int) -> str:
    return f'\n\ndef test_chore_{k + 1}():\n    assert {MENU[i][2]}, "not done: {MENU[i][0]}"\n'


def draw(rng: random.Random) -> tuple[int, list[int], list[int]]:
    """(n, the picked chores in instruction order, the others)."""
    n = rng.choice(N_VALUES)
    picked = rng.sample(range(len(MENU)), n)
    return n, picked, [i for i in range(len(MENU)) if i not in picked]


def key_of(n: int, picked: list[int]) -> str:
    return f"choresn:n{n}:" + "+".join(str(i) for i in sorted(picked))


def choresn_family(rng: random.Random) -> SynthSpec:
    return _choresn(rng, "choresn", weak=False)


def choresnsome_family(rng: random.Random) -> SynthSpec:
    return _choresn(rng, "choresnsome", weak=True)


def _choresn(rng: random.Random, family: str, *, weak: bool) -> SynthSpec:
    n, picked, others = draw(rng)
    replies = math.ceil(n / 2)
    done = picked[: 2 * rng.randint(1, replies)] if weak else picked
    instr = f"In the current directory:\n{menu_steps(picked)}"
    tests = "".join(one_chore_test(k, i) for k, i in enumerate(done)) + not_asked_test(others)
    return SynthSpec(
        family,
        instr,
        chore_replies(done),
        tests,
        files=dict(FILES),
        tags=("menu", "count"),
        content_key=key_of(n, picked),
        max_turns=oracle_turns(n),
    )
