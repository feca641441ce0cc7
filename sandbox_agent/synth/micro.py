"""A micro-family for learning in CI (``tests/test_learning_ci.py``): one command, four tests.

``touch4``: "create these four files: a.txt b.txt c.txt d.txt"; the oracle is one ``touch`` naming the four
words; each file is its own test, so a reply that copies three of the four names right earns 3 of 4 (a dense
reward with signal from the first step). A warm start trained on this oracle names all four (3.33 of 4 at
temperature 1): too little left for RL to show, hence ``touchsome``.

``touchsome``: the same instruction, but a weaker demonstrator's oracle: it creates only the first k of the
four (k uniform in 1-4), and the task's tests check those k. The ``micro`` warm start imitates it, so it
names 1, 2, 3 or 4 of the files as its demonstrator did (~2.5 of 4 on touch4): a policy with one decision
RL can fix (stop early or name the next file), which ``tests/test_learning_ci.py`` trains on ``touch4``.

Both share one content key space, the set of the four names asked for (``touch:<names, sorted>``): a touch4
task held out for eval has no touchsome twin among the warm start's demonstrations.

Not in the default corpus: ``generate(..., families=["touch4"])`` names them.
"""

from __future__ import annotations

import random

from sandbox_agent.synth.common import SynthSpec, pick

# one token each for the shipped tokenizer (" data", "`data"): copying a name is one decision, not five (the
# WORDS of the other families split into 3-6 pieces, and a 4.5 M model learns to copy those far slower)
NAMES = (
    "log",
    "data",
    "out",
    "config",
    "main",
    "src",
    "report",
    "notes",
    "result",
    "input",
    "output",
    "list",
    "name",
    "value",
    "item",
    "user",
    "path",
    "time",
    "line",
    "table",
    "task",
    "code",
    "error",
    "build",
)


def touch4_family(rng: random.Random) -> SynthSpec:
    return _touch(rng, "touch4", all_four=True)


def touchsome_family(rng: random.Random) -> SynthSpec:
    return _touch(rng, "touchsome", all_four=False)


def _touch(rng: random.Random, family: str, *, all_four: bool) -> SynthSpec:
    names = pick(rng, NAMES, 4)
    pick_names = list(names)
    # the names as the reply writes them (" data" is one token in both): copying is a lookup, not a mapping
    # from "`data" to " data" that a few SFT steps do not learn (the backticked version stayed at chance)
    listed = " ".join(f"{n}.txt" for n in names)
    instr = f"In the current directory, create these four files: {listed}"
    if not all_four:  # the weaker demonstrator stops after k names; its task tests those k
        names = names[: rng.randint(1, 4)]
    sol = "touch " + " ".join(f"{n}.txt" for n in names) + "\n"
    tests = "".join(
        f"""

def test_file_{i}():
    assert (WORK / "{n}.txt").is_file(), "{n}.txt was not created"
"""
        for i, n in enumerate(names)
    )
    # one key space for both families (the set of four names asked for): touchsome demonstrates touch4's tasks
    key = "touch:" + ",".join(sorted(pick_names))
    return SynthSpec(family, instr, sol, tests, tags=("touch",), content_key=key)
