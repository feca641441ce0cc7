"""Families for learning from scratch (the ``learn`` preset): short, multi-step shell chores whose every step
is one command that copies names from the instruction, each step checked by its own test (a dense 4-test
reward). A few-million-parameter model trained from random weights can learn them from a few hundred oracle
demonstrations; the 11 default families stay the held-out, harder set.

- ``mkfile``: make a directory, write two words into two files, delete a stray file (one reply);
- ``copy``: copy a file, append a word to the copy, rename another file, count a file's lines (two replies).

The instruction writes every name exactly as the command does (``alpha/olive.txt`` after a space, no
backticks), so a name in the reply is the very token sequence it is in the instruction. Version 1 put the names
in backticks, which the tokenizer splits differently (``sage`` was ``s|age`` in the instruction and `` s|age``
in the command, ``cobalt`` ``c|ob|al|t`` and `` co|b|al|t``): copying a name was re-tokenizing it. Its 4.5 M
warm start got 96% of names right greedily but resolved 0% of held-out tasks at temperature 1. Version 2 drew
one-token names: the SFT loss sat at the guessing plateau (~0.6) for 600 steps, since a one-token name leaves
no in-name continuation to learn copying from (the pieces after a name's first one are copied by induction,
which forms first and then carries the first piece).

Not in the default corpus (``FAMILIES``): ``generate(..., families=["mkfile", "copy"])`` names them.
"""

from __future__ import annotations

import random

from sandbox_agent.synth.common import WORDS, SynthSpec, ident, para, pick

VERSION = 3  # bump when a family's text or checks change (the warm start caches demonstrations by it)
NAMES = WORDS


def mkfile_family(rng: random.Random) -> SynthSpec:
    d, f1, f2 = pick(rng, NAMES, 3)
    w1, w2 = pick(rng, WORDS, 2)
    junk = f"{ident(rng)}"
    instr = (
        f"In the current directory:\n"
        f"1. create the directory {d};\n"
        f"2. write the word {w1} into the file {d}/{f1}.txt;\n"
        f"3. write the word {w2} into the file {f2}.txt;\n"
        f"4. delete the file {junk}.tmp."
    )
    sol = f"mkdir -p {d}\necho {w1} > {d}/{f1}.txt\necho {w2} > {f2}.txt\nrm -f {junk}.tmp\n"
    tests = f"""
def test_dir():
    assert (WORK / {d!r}).is_dir()


def test_first_file():
    assert read("{d}/{f1}.txt").strip() == {w1!r}


def test_second_file():
    assert read("{f2}.txt").strip() == {w2!r}


def test_junk_deleted():
    assert not (WORK / "{junk}.tmp").exists()
"""
    key = f"mkfile:{d}/{f1}={w1};{f2}={w2};-{junk}"  # the junk file's words are not checked
    files: dict[str, str | bytes] = {f"{junk}.tmp": para(rng, 3) + "\n"}
    return SynthSpec("mkfile", instr, sol, tests, files=files, tags=("mkdir", "echo"), content_key=key)


def copy_family(rng: random.Random) -> SynthSpec:
    src, dst, old, new, count = pick(rng, NAMES, 5)
    w = rng.choice(WORDS)
    n = rng.randint(2, 6)
    body = "".join(para(rng, 3) + "\n" for _ in range(n))
    other = para(rng, 4) + "\n"
    instr = (
        f"In the current directory:\n"
        f"1. copy {src}.txt to {dst}.txt;\n"
        f"2. append a line with the word {w} to {dst}.txt;\n"
        f"3. rename {old}.log to {new}.log;\n"
        f"4. write the number of lines of {src}.txt into {count}.txt."
    )
    sol = f"cp {src}.txt {dst}.txt\necho {w} >> {dst}.txt\n\nmv {old}.log {new}.log\nwc -l < {src}.txt > {count}.txt\n"
    tests = f"""
def test_copied():
    assert read("{dst}.txt").startswith({body!r})


def test_appended():
    assert read("{dst}.txt") == {body + w + chr(10)!r}


def test_renamed():
    assert read("{new}.log") == {other!r} and not (WORK / "{old}.log").exists()


def test_count():
    assert read("{count}.txt").strip() == "{n}" and read("{src}.txt") == {body!r}
"""
    return SynthSpec(
        "copy", instr, sol, tests, files={f"{src}.txt": body, f"{old}.log": other}, tags=("cp", "mv", "wc")
    )
