"""``observe``: the file to act on, or the name to write, is only in what a command prints. The instruction
never names it; the oracle reads it first (``cat`` or ``ls``), then acts on what it read:

- ``mkdir``: ``secret.txt`` holds a name; create the directory of that name;
- ``rm``: ``target.txt`` names one of four ``.log`` files; delete that one (the three others must stay);
- ``ls``: the directory ``inbox`` holds one file; create ``<its name>.done`` in the current directory.

Names are a word of ``common.WORDS`` and a digit (600 of them), drawn per task, so a policy that ignores the
observation is right about one time in hundreds. Three turns: read, act, DONE; ``max_turns`` is 3. Tests: the
asked-for change, the inputs untouched, and nothing else created or deleted (doing what was not asked fails).

The content key is the variant and the names it needs (``observe:<variant>:<name>[:<decoys>]``), split by key;
the ``ls`` variant is held out whole for OOD (``OOD_PREFIX``: every ``ls`` task is a test task), so the
policy meets listing a directory to act on its entry only at test time.
"""

from __future__ import annotations

import random

from sandbox_agent.synth.common import WORDS, SynthSpec

VARIANTS: tuple[str, ...] = ("mkdir", "rm", "ls")
OOD_PREFIX = "observe:ls:"
MAX_TURNS = 3  # read, act, DONE


def _name(rng: random.Random) -> str:
    return f"{rng.choice(WORDS)}{rng.randrange(10)}"


def _names(rng: random.Random, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        n = _name(rng)
        if n not in out:
            out.append(n)
    return out


def _only_test(expected: list[str]) -> str:
    """``test_nothing_else``: the work dir holds exactly ``expected`` (sorted names, directories included)."""
    return f"""

def test_nothing_else():
    have = sorted(p.name for p in WORK.iterdir() if not p.name.startswith(".") and p.name != "__pycache__")
    assert have == {sorted(expected)!r}, f"the work dir holds {{have}}"
"""


def observe_family(rng: random.Random) -> SynthSpec:
    variant = rng.choice(VARIANTS)
    if variant == "mkdir":
        name = _name(rng)
        files: dict[str, str | bytes] = {"secret.txt": name + "\n"}
        instr = "The file secret.txt holds a name. Create a directory with exactly that name in the current directory."
        sol = f"cat secret.txt\n\nmkdir -p {name}\n"
        tests = f"""

def test_directory_created():
    assert (WORK / {name!r}).is_dir(), "no directory named as secret.txt says"


def test_secret_untouched():
    assert read("secret.txt") == {name + chr(10)!r}
""" + _only_test(["secret.txt", name])
        key = f"observe:mkdir:{name}"
    elif variant == "rm":
        names = _names(rng, 4)
        target = names[0]
        files = {"target.txt": f"{target}.log\n", **{f"{n}.log": f"log of {n}\n" for n in sorted(names)}}
        instr = "The file target.txt names one of the .log files here. Delete that file, and only that file."
        sol = f"cat target.txt\n\nrm -f {target}.log\n"
        keep = sorted(f"{n}.log" for n in names[1:])
        tests = f"""

def test_target_deleted():
    assert not (WORK / {target + ".log"!r}).exists(), "the file target.txt names is still there"


def test_others_kept():
    for f in {keep!r}:
        assert (WORK / f).is_file(), f"{{f}} was deleted although target.txt does not name it"
""" + _only_test(["target.txt", *keep])
        key = f"observe:rm:{target}:" + ",".join(sorted(names[1:]))
    else:
        name = _name(rng)
        files = {f"inbox/{name}.txt": "new\n"}
        instr = (
            "The directory inbox holds one file. In the current directory, create an empty file named like it "
            "with .done added (for inbox/x.txt: x.txt.done)."
        )
        sol = f"ls inbox\n\ntouch {name}.txt.done\n"
        tests = f"""

def test_done_file_created():
    assert (WORK / {name + ".txt.done"!r}).is_file(), "no <name>.done file for the file in inbox"


def test_inbox_untouched():
    assert sorted(p.name for p in (WORK / "inbox").iterdir()) == [{name + ".txt"!r}]
""" + _only_test(["inbox", f"{name}.txt.done"])
        key = f"observe:ls:{name}"
    return SynthSpec(
        "observe", instr, sol, tests, files=files, tags=("observe", variant), content_key=key, max_turns=MAX_TURNS
    )
