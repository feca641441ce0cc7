"""A micro-family for learning in CI (``tests/test_learning_ci.py``): one command, four tests.

``touch4``: "create these four files: a.txt b.txt c.txt d.txt"; the oracle is one ``touch`` naming the four
words; each file is its own test, so a reply that copies three of the four names right earns 3 of 4 (a dense
reward with signal from the first step). The ``micro`` warm-start recipe (``t1async.learner.warmstart``, 240
SFT steps) copies all four greedily and 3.33 of 4 on average sampled at temperature 1.

Not in the default corpus: ``generate(..., families=["touch4"])`` names it.
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
    names = pick(rng, NAMES, 4)
    # the names as the reply writes them (" data" is one token in both): copying is a lookup, not a mapping
    # from "`data" to " data" that a few SFT steps do not learn (the backticked version stayed at chance)
    listed = " ".join(f"{n}.txt" for n in names)
    instr = f"In the current directory, create these four files: {listed}"
    sol = "touch " + " ".join(f"{n}.txt" for n in names) + "\n"
    tests = "".join(
        f"""

def test_file_{i}():
    assert (WORK / "{n}.txt").is_file(), "{n}.txt was not created"
"""
        for i, n in enumerate(names)
    )
    return SynthSpec("touch4", instr, sol, tests, tags=("touch",))
