"""Families: file and directory operations, find + xargs, permissions."""

from __future__ import annotations

import random
from typing import cast

from sandbox_agent.synth.common import EXTS, WORDS, SynthSpec, ident, para, pick


def files_family(rng: random.Random) -> SynthSpec:
    inbox = rng.choice(["inbox", "incoming", "drop", "uploads", "staging"])
    exts = pick(rng, EXTS, rng.randint(2, 3))
    names: dict[str, list[str]] = {e: sorted({ident(rng) for _ in range(rng.randint(2, 5))}) for e in exts}
    other = rng.choice([e for e in EXTS if e not in exts])
    keep = sorted({ident(rng) for _ in range(rng.randint(1, 3))})
    files: dict[str, str | bytes] = {f"{inbox}/{n}.{e}": para(rng, 6) + "\n" for e, ns in names.items() for n in ns}
    files.update({f"{inbox}/{n}.{other}": para(rng, 4) + "\n" for n in keep})
    dest = rng.choice(["sorted", "by_type", "archive", "organized"])
    manifest = rng.choice(["manifest.txt", "moved.txt", "index.txt"])
    moved = sorted(f"{n}.{e}" for e, ns in names.items() for n in ns)
    ext_list = ", ".join(f".{e}" for e in exts)
    instr = (
        f"The directory `{inbox}/` in the current directory holds files of several types.\n"
        f"Move every file with extension {ext_list} into `{dest}/<ext>/` (for example a `.{exts[0]}` file "
        f"goes to `{dest}/{exts[0]}/`), keeping its file name. Leave all other files in `{inbox}/`.\n"
        f"Then write `{manifest}` in the current directory listing the names of the moved files (name "
        f"only, no directory), sorted (byte order, as `LC_ALL=C sort` does), one per line."
    )
    sol = f"""\
for e in {" ".join(exts)}; do
  mkdir -p {dest}/$e
  for f in {inbox}/*.$e; do [ -e "$f" ] && mv "$f" {dest}/$e/; done
done
find {dest} -type f -printf '%f\\n' | LC_ALL=C sort > {manifest}
"""
    tests = f"""
NAMES = {names!r}
KEEP = {[f"{n}.{other}" for n in keep]!r}


def test_moved_into_type_dirs():
    for ext, ns in NAMES.items():
        got = sorted(p.name for p in (WORK / {dest!r} / ext).iterdir())
        assert got == sorted(f"{{n}}.{{ext}}" for n in ns), ext


def test_inbox_keeps_only_other_files():
    assert sorted(p.name for p in (WORK / {inbox!r}).iterdir()) == sorted(KEEP)


def test_contents_preserved():
    orig = {files!r}
    for ext, ns in NAMES.items():
        for n in ns:
            assert (WORK / {dest!r} / ext / f"{{n}}.{{ext}}").read_text() == orig[f"{inbox}/{{n}}.{{ext}}"]


def test_manifest():
    assert lines({manifest!r}) == {moved!r}
"""
    return SynthSpec("files", instr, sol, tests, files=files, tags=("mv", "mkdir"))


def find_family(rng: random.Random) -> SynthSpec:
    root = rng.choice(["tree", "src", "workspace", "data"])
    ext = rng.choice(["log", "txt", "dat"])
    token = rng.choice(["TODO", "FIXME", "XXX", "HACK"]) + str(rng.randint(1, 99))
    threshold = rng.choice([100, 200, 300])
    files: dict[str, str] = {}
    dirs = [root] + [f"{root}/{w}" for w in pick(rng, WORDS, 3)]
    dirs += [f"{d}/{rng.choice(WORDS)}" for d in dirs[1:]]
    for d in dirs:
        for _ in range(rng.randint(2, 4)):
            e = rng.choice([ext, ext, "md", "tmp", "cfg"])
            size = rng.choice([20, 60, threshold + rng.randint(10, 200), threshold + 400])
            body = (para(rng, 3) + "\n") * (size // 25 + 1)
            if rng.random() < 0.35:
                body += f"note {token} here\n"
            files[f"{d}/{ident(rng)}.{e}"] = body
    files[f"{dirs[-1]}/{ident(rng)}.tmp"] = "scratch\n"
    files[f"{dirs[0]}/{ident(rng)}.{ext}"] = (para(rng, 4) + "\n") * (threshold // 20 + 3)
    large = sorted(p for p, b in files.items() if p.endswith(f".{ext}") and len(b.encode()) > threshold)
    tmps = sorted(p for p in files if p.endswith(".tmp"))
    with_token = sum(1 for p, b in files.items() if not p.endswith(".tmp") and token in b)
    instr = (
        f"Inside `{root}/` (in the current directory) there is a tree of files. Do three things:\n"
        f"1. Write `large.txt`: the paths (relative to the current directory, like `{root}/...`) of all "
        f"`.{ext}` files anywhere under `{root}/` that are larger than {threshold} bytes, "
        f"sorted in byte order (`LC_ALL=C sort`), one per line.\n"
        f"2. Delete every `*.tmp` file under `{root}/`.\n"
        f"3. After deleting them, write `token_count.txt` with the number of files under `{root}/` that "
        f"contain the text `{token}`."
    )
    sol = f"""\
find {root} -type f -name '*.{ext}' -size +{threshold}c | LC_ALL=C sort > large.txt
find {root} -type f -name '*.tmp' -print0 | xargs -0 -r rm -f
grep -rl '{token}' {root} | wc -l > token_count.txt
"""
    tests = f"""
def test_large_files():
    assert lines("large.txt") == {large!r}


def test_tmp_deleted():
    assert not list((WORK / {root!r}).rglob("*.tmp"))
    for p in {tmps!r}:
        assert not (WORK / p).exists()


def test_other_files_kept():
    for p in {sorted(p for p in files if not p.endswith(".tmp"))!r}:
        assert (WORK / p).is_file(), p


def test_token_count():
    assert read("token_count.txt").strip() == "{with_token}"
"""
    spec_files = cast("dict[str, str | bytes]", files)  # only str values: read above as text
    return SynthSpec("find", instr, sol, tests, files=spec_files, difficulty="medium", tags=("find", "xargs"))


def perms_family(rng: random.Random) -> SynthSpec:
    sdir = rng.choice(["scripts", "bin", "tools"])
    scripts = sorted({f"{ident(rng, 1)}.sh" for _ in range(rng.randint(2, 4))})
    others = sorted({f"{ident(rng, 1)}.txt" for _ in range(2)} - set(scripts))
    secret = rng.choice(["secret", "keys", "private"])
    secret_file = f"{rng.choice(['key', 'token', 'id_rsa', 'password'])}.txt"
    shared = rng.choice(["shared", "team", "public_dir"])
    smode = rng.choice([0o600, 0o400])
    dmode = rng.choice([0o750, 0o770, 0o755])
    files: dict[str, str | bytes] = {f"{sdir}/{s}": f"#!/bin/bash\necho {s}\n" for s in scripts}
    files.update({f"{sdir}/{o}": para(rng, 5) + "\n" for o in others})
    files[f"{secret}/{secret_file}"] = f"{ident(rng, 3)}\n"
    modes = {p: 0o644 for p in files}
    instr = (
        f"Fix the permissions in the current directory:\n"
        f"- every `.sh` file in `{sdir}/` must have mode 755 (other files there stay 644);\n"
        f"- `{secret}/{secret_file}` must have mode {smode:o} and `{secret}/` itself mode 700;\n"
        f"- create a directory `{shared}/` with mode {dmode:o}."
    )
    sol = f"""\
chmod 755 {sdir}/*.sh
chmod {smode:o} {secret}/{secret_file}
chmod 700 {secret}
mkdir -p {shared}
chmod {dmode:o} {shared}
"""
    tests = f"""
def mode(rel):
    return stat.S_IMODE((WORK / rel).stat().st_mode)


def test_scripts_executable():
    for s in {scripts!r}:
        assert mode("{sdir}/" + s) == 0o755, s
        assert run("./{sdir}/" + s).stdout.strip() == s


def test_other_files_unchanged():
    for o in {others!r}:
        assert mode("{sdir}/" + o) == 0o644, o


def test_secret_locked_down():
    assert mode("{secret}/{secret_file}") == {smode}
    assert mode("{secret}") == 0o700


def test_shared_dir():
    assert (WORK / "{shared}").is_dir()
    assert mode("{shared}") == {dmode}
"""
    return SynthSpec("perms", instr, sol, tests, files=files, modes=modes, tags=("chmod",))
