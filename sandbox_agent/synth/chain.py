"""``chain``: a longer chain towards T1's horizons. 8 to 12 chores of a menu of 15 (``chores``' nine and six
more of the same kind, fixed arguments), one chore a reply, then DONE: 9 to 13 turns, and ``max_turns`` is
exactly the oracle's (``SynthSpec.max_turns``). One test per requested chore, plus ``test_not_asked`` (every
unrequested chore of the menu undone), so a chore more than asked fails a test.

No two chores of the menu interfere whatever their order (each touches its own files; ``copy data.csv`` and
``count data.csv`` only read). The content key is the chore set (``chain:<menu indices, sorted>``): C(15, 8..12)
sets, the split holds out whole sets.
"""

from __future__ import annotations

import random

from sandbox_agent.synth.chores import FILES as CHORES_FILES
from sandbox_agent.synth.chores import MENU as CHORES_MENU
from sandbox_agent.synth.common import SynthSpec

MENU: tuple[tuple[str, str, str, str], ...] = CHORES_MENU + (
    ("create the directory logs", "mkdir -p logs", '(WORK / "logs").is_dir()', 'not (WORK / "logs").exists()'),
    ("delete the file tmp.txt", "rm -f tmp.txt", 'not (WORK / "tmp.txt").exists()', '(WORK / "tmp.txt").exists()'),
    (
        "write world into planet.txt",
        "echo world > planet.txt",
        'read("planet.txt").strip() == "world"',
        'not (WORK / "planet.txt").exists()',
    ),
    (
        "copy data.csv to data.bak",
        "cp data.csv data.bak",
        'read("data.bak") == read("data.csv")',
        'not (WORK / "data.bak").exists()',
    ),
    (
        "create the empty file lock.pid",
        "touch lock.pid",
        '(WORK / "lock.pid").is_file()',
        'not (WORK / "lock.pid").exists()',
    ),
    (
        "make build.sh executable",
        "chmod +x build.sh",
        'os.access(WORK / "build.sh", os.X_OK)',
        'not os.access(WORK / "build.sh", os.X_OK)',
    ),
)
FILES: dict[str, str] = {**CHORES_FILES, "tmp.txt": "scratch\n", "build.sh": "#!/bin/bash\necho building\n"}
N_RANGE = (8, 12)


def chain_family(rng: random.Random) -> SynthSpec:
    n = rng.randint(*N_RANGE)
    picked = rng.sample(range(len(MENU)), n)
    others = [i for i in range(len(MENU)) if i not in picked]
    last = n - 1
    steps = "\n".join(f"{k + 1}. {MENU[i][0]}{'.' if k == last else ';'}" for k, i in enumerate(picked))
    tests = "".join(
        f'\n\ndef test_chore_{k + 1}():\n    assert {MENU[i][2]}, "not done: {MENU[i][0]}"\n'
        for k, i in enumerate(picked)
    )
    body = "\n".join(f'    assert {MENU[j][3]}, "done although not asked: {MENU[j][0]}"' for j in others)
    tests += f"\n\ndef test_not_asked():\n{body}\n"
    return SynthSpec(
        "chain",
        f"In the current directory:\n{steps}",
        "\n\n".join(MENU[i][1] for i in picked) + "\n",  # one chore a reply
        tests,
        files=dict(FILES),
        tags=("menu", "long"),
        content_key="chain:" + "+".join(str(i) for i in sorted(picked)),
        max_turns=n + 1,
    )
