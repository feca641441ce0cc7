"""A micro-family for learning in CI (``tests/test_learning_ci.py``): one command, four tests.

``touch4``: "create the files `a.txt`, `b.txt`, `c.txt` and `d.txt`"; the oracle is one ``touch`` naming the
four words; each file is its own test, so a reply that copies three of the four names right earns 3 of 4 (a
dense reward with signal from the first step). A few dozen SFT steps from random weights give a policy that
copies some names and misses others when sampled at temperature 1: RL on it raises the mean reward within a
few minutes on 2 cores. The ``micro`` warm-start recipe (``t1async.learner.warmstart``) trains it.

Not in the default corpus: ``generate(..., families=["touch4"])`` names it.
"""

from __future__ import annotations

import random

from sandbox_agent.synth.common import SynthSpec, pick

# one token each for the shipped tokenizer (" data", "`data"): copying a name is one decision, not five (the
# WORDS of the other families split into 3-6 pieces, and a 4.5 M model learns to copy those far slower)
NAMES = ("log", "data", "out", "config", "main", "src", "report", "notes", "result", "input", "output", "list",
         "name", "value", "item", "user", "path", "time", "line", "table", "task", "code", "error", "build")  # fmt: skip


def touch4_family(rng: random.Random) -> SynthSpec:
    names = pick(rng, NAMES, 4)
    listed = ", ".join(f"`{n}.txt`" for n in names[:3]) + f" and `{names[3]}.txt`"
    instr = f"In the current directory, create the files {listed}."
    sol = "touch " + " ".join(f"{n}.txt" for n in names) + "\n"
    tests = "".join(f"""

def test_file_{i}():
    assert (WORK / "{n}.txt").is_file(), "{n}.txt was not created"
""" for i, n in enumerate(names))  # fmt: skip
    return SynthSpec("touch4", instr, sol, tests, tags=("touch",))
