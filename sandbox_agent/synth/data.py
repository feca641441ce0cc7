"""Families: JSON transforms (jq), archives (tar/gzip/zip)."""

from __future__ import annotations

import io
import json
import random
import zipfile

from sandbox_agent.synth.common import CITIES, NAMES, WORDS, SynthSpec, ident, para, pick


def json_family(rng: random.Random) -> SynthSpec:
    src = rng.choice(["users.json", "people.json", "members.json"])
    names = pick(rng, NAMES, rng.randint(5, 12))
    ages = rng.sample(range(18, 90), len(names))  # distinct: a unique oldest
    cities = pick(rng, CITIES, rng.randint(2, 4))
    users = [
        {"name": n, "age": a, "city": rng.choice(cities), "active": rng.random() < 0.5} for n, a in zip(names, ages)
    ]
    users[rng.randrange(len(users))]["active"] = True
    text = json.dumps(users, indent=2) + "\n"
    active = sorted(u["name"] for u in users if u["active"])
    by_city: dict[str, int] = {}
    for u in users:
        by_city[u["city"]] = by_city.get(u["city"], 0) + 1
    oldest = max(users, key=lambda u: u["age"])["name"]
    min_age = rng.choice([30, 40, 50])
    older = sorted((u for u in users if u["age"] >= min_age), key=lambda u: u["name"])
    instr = (
        f"`{src}` in the current directory is a JSON array of users (name, age, city, active).\n"
        f"1. Write `active.json`: a JSON array of the names of the active users, sorted.\n"
        f"2. Write `by_city.json`: a JSON object mapping each city to its number of users.\n"
        f"3. Write `oldest.txt` containing the name of the oldest user.\n"
        f'4. Write `age_{min_age}_plus.json`: an array of `{{"name": ..., "city": ...}}` objects for the '
        f"users aged {min_age} or more, sorted by name."
    )
    sol = f"""\
jq '[.[] | select(.active) | .name] | sort' {src} > active.json
jq 'group_by(.city) | map({{key: .[0].city, value: length}}) | from_entries' {src} > by_city.json
jq -r 'max_by(.age) | .name' {src} > oldest.txt
jq '[.[] | select(.age >= {min_age}) | {{name, city}}] | sort_by(.name)' {src} > age_{min_age}_plus.json
"""
    tests = f"""
def test_active():
    assert json.loads(read("active.json")) == {active!r}


def test_by_city():
    assert json.loads(read("by_city.json")) == {by_city!r}


def test_oldest():
    assert read("oldest.txt").strip() == {oldest!r}


def test_age_filter():
    assert json.loads(read("age_{min_age}_plus.json")) == {[{"name": u["name"], "city": u["city"]} for u in older]!r}
"""
    return SynthSpec("json", instr, sol, tests, files={src: text}, tags=("jq", "json"))


def _zip_bytes(members: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, body in members.items():
            z.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), body)
    return buf.getvalue()


def archive_family(rng: random.Random) -> SynthSpec:
    proj = rng.choice(["project", "site", "app", "docs"])
    tarname = f"{rng.choice(['backup', 'snapshot', 'release'])}.tar.gz"
    logname = f"{rng.choice(['app', 'debug', 'trace'])}.log"
    zipname = f"{rng.choice(['bundle', 'assets', 'payload'])}.zip"
    outdir = rng.choice(["unzipped", "extracted", "assets_out"])
    pfiles = {f"{proj}/{ident(rng)}.txt": para(rng, 8) + "\n" for _ in range(rng.randint(2, 4))}
    pfiles[f"{proj}/{rng.choice(WORDS)}/{ident(rng)}.md"] = para(rng, 10) + "\n"
    zmembers = {f"{ident(rng)}.txt": para(rng, 6) + "\n" for _ in range(rng.randint(2, 4))}
    zmembers[f"{rng.choice(WORDS)}/{ident(rng)}.cfg"] = f"key={ident(rng)}\n"
    log = "".join(f"{i:05d} {para(rng, 5)}\n" for i in range(rng.randint(50, 200)))
    files: dict[str, str | bytes] = dict(pfiles)
    files[zipname] = _zip_bytes(zmembers)
    files[logname] = log
    instr = (
        f"In the current directory:\n"
        f"1. Create `{tarname}`, a gzip-compressed tar archive of the directory `{proj}/` (member names "
        f"must start with `{proj}/`).\n"
        f"2. Extract `{zipname}` into a new directory `{outdir}/`.\n"
        f"3. Compress `{logname}` with gzip into `{logname}.gz`, keeping the original `{logname}`."
    )
    sol = f"""\
tar -czf {tarname} {proj}
mkdir -p {outdir} && unzip -q -o {zipname} -d {outdir}
gzip -k -f {logname}
"""
    tests = f"""
import gzip
import tarfile

PFILES = {pfiles!r}
ZMEMBERS = {zmembers!r}


def test_tar_members():
    with tarfile.open(WORK / {tarname!r}, "r:gz") as t:
        names = [m.name for m in t.getmembers() if m.isfile()]
        assert sorted(names) == sorted(PFILES)
        for n in names:
            assert t.extractfile(n).read().decode() == PFILES[n]


def test_zip_extracted():
    for name, body in ZMEMBERS.items():
        assert (WORK / {outdir!r} / name).read_text() == body, name


def test_gzip_log():
    with gzip.open(WORK / {(logname + ".gz")!r}, "rt") as f:
        assert f.read() == {log!r}


def test_original_log_kept():
    assert read({logname!r}) == {log!r}
"""
    return SynthSpec("archive", instr, sol, tests, files=files, tags=("tar", "gzip", "unzip"))
