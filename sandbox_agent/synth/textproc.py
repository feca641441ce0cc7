"""Families: text processing (grep/sed/awk), CSV transforms, log analysis."""

from __future__ import annotations

import random

from sandbox_agent.synth.common import CITIES, WORDS, SynthSpec, para, pick


def text_family(rng: random.Random) -> SynthSpec:
    src = rng.choice(["notes.txt", "journal.txt", "input.txt", "story.txt"])
    target, old = pick(rng, WORDS, 2)
    new = rng.choice([w for w in WORDS if w not in (target, old)]).upper()
    rows = []
    for _ in range(rng.randint(12, 30)):
        ws = [rng.choice(WORDS) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws) + 1), rng.choice([target, target.upper(), target.capitalize()]))
        rows.append(" ".join(ws))
    rows.insert(rng.randrange(len(rows)), f"{target.capitalize()} {old} {para(rng, 2)}")
    text = "\n".join(rows) + "\n"
    matches = [r for r in rows if target in r.lower()]
    replaced = text.replace(old, new)
    cols = [r.split()[1] for r in rows if len(r.split()) >= 3]
    instr = (
        f"`{src}` in the current directory is a text file. Create three files next to it:\n"
        f"1. `matches.txt`: every line of `{src}` that contains `{target}` (ignoring case), in the original order.\n"
        f"2. `replaced.txt`: a copy of `{src}` in which every occurrence of `{old}` is replaced by `{new}`.\n"
        f"3. `second_words.txt`: for every line that has at least 3 words, its second word, one per line, "
        f"in the original order.\n"
        f"Do not modify `{src}`."
    )
    sol = f"""\
grep -i '{target}' {src} > matches.txt
sed 's/{old}/{new}/g' {src} > replaced.txt
awk 'NF >= 3 {{ print $2 }}' {src} > second_words.txt
"""
    tests = f"""
def test_matches():
    assert read("matches.txt").splitlines() == {matches!r}


def test_replaced():
    assert read("replaced.txt") == {replaced!r}


def test_second_words():
    assert read("second_words.txt").splitlines() == {cols!r}


def test_source_unchanged():
    assert read({src!r}) == {text!r}
"""
    return SynthSpec("text", instr, sol, tests, files={src: text}, tags=("grep", "sed", "awk"))


def csv_family(rng: random.Random) -> SynthSpec:
    src = rng.choice(["sales.csv", "orders.csv", "ledger.csv"])
    regions = sorted(pick(rng, CITIES, rng.randint(3, 5)))
    products = pick(rng, WORDS, rng.randint(3, 6))
    min_qty = rng.randint(5, 15)
    rows = []
    for i in range(rng.randint(15, 40)):
        rows.append((i + 1, rng.choice(regions), rng.choice(products), rng.randint(1, 25), rng.randint(50, 9999)))
    # make the top product (by total quantity) unique
    qty: dict[str, int] = {}
    for r in rows:
        qty[r[2]] = qty.get(r[2], 0) + r[3]
    top = max(qty, key=lambda p: (qty[p], p))
    rows.append((len(rows) + 1, regions[0], top, 30, 100))
    cents: dict[str, int] = {}
    for _, reg, _, q, p in rows:
        cents[reg] = cents.get(reg, 0) + q * p
    text = "id,region,product,qty,price\n" + "".join(
        f"{i},{r},{pr},{q},{p // 100}.{p % 100:02d}\n" for i, r, pr, q, p in rows
    )
    summary = "region,total\n" + "".join(f"{r},{c // 100}.{c % 100:02d}\n" for r, c in sorted(cents.items()))
    filtered = [text.splitlines()[0]] + [ln for ln, r in zip(text.splitlines()[1:], rows) if r[3] >= min_qty]
    instr = (
        f"`{src}` (in the current directory) has the columns id,region,product,qty,price.\n"
        f"1. Write `summary.csv` with the header `region,total` and one row per region, sorted by region, "
        f"where total is the sum of qty*price over that region's rows, printed with exactly two decimals.\n"
        f"2. Write `top_product.txt` containing the product with the largest total qty.\n"
        f"3. Write `filtered.csv`: the header line and every row with qty >= {min_qty}, in the original order."
    )
    sol = f"""\
{{ echo region,total; awk -F, 'NR > 1 {{ t[$2] += $4 * $5 }} END {{ for (r in t) printf "%s,%.2f\\n", r, t[r] }}' {src} | LC_ALL=C sort; }} > summary.csv
awk -F, 'NR > 1 {{ q[$3] += $4 }} END {{ for (p in q) print q[p], p }}' {src} | sort -n | tail -1 | cut -d' ' -f2 > top_product.txt
awk -F, 'NR == 1 || $4 >= {min_qty}' {src} > filtered.csv
"""  # noqa: E501 (the task's oracle script: one shell line per output file)
    tests = f"""
def test_summary_header():
    assert lines("summary.csv")[0] == "region,total"


def test_summary_rows():
    assert lines("summary.csv")[1:] == {summary.splitlines()[1:]!r}


def test_top_product():
    assert read("top_product.txt").strip() == {top!r}


def test_filtered():
    assert lines("filtered.csv") == {filtered!r}
"""
    return SynthSpec("csv", instr, sol, tests, files={src: text}, difficulty="medium", tags=("csv", "awk"))


def logs_family(rng: random.Random) -> SynthSpec:
    src = rng.choice(["access.log", "web.log", "server.log"])
    ips = [f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}" for _ in range(rng.randint(5, 8))]
    ips = list(dict.fromkeys(ips))
    counts = rng.sample(range(1, 30), len(ips))  # distinct counts: no ties in the top 3
    paths = ["/" + "/".join(pick(rng, WORDS, rng.randint(1, 2))) for _ in range(8)]
    entries = []
    for ip, c in zip(ips, counts):
        for _ in range(c):
            status = rng.choice([200, 200, 200, 301, 404, 500, 503])
            entries.append((ip, rng.choice(paths), status, rng.randint(100, 5000)))
    rng.shuffle(entries)
    text = "".join(
        f'{ip} - - [{10 + i // 60:02d}/Mar/2024:12:{i % 60:02d}:00 +0000] "GET {p} HTTP/1.1" {s} {b}\n'
        for i, (ip, p, s, b) in enumerate(entries)
    )
    top = sorted(zip(counts, ips), reverse=True)[:3]
    n5xx = sum(1 for e in entries if e[2] >= 500)
    p404 = sorted({e[1] for e in entries if e[2] == 404})
    instr = (
        f"`{src}` in the current directory is a web server access log (common log format).\n"
        f"1. Write `top_ips.txt`: the 3 client IPs with the most requests, most first, one per line as "
        f"`<count> <ip>`.\n"
        f"2. Write `errors.txt` with the number of requests answered with a 5xx status.\n"
        f"3. Write `not_found.txt`: the distinct paths that got a 404, sorted (`LC_ALL=C sort`), one per line."
    )
    sol = f"""\
awk '{{ print $1 }}' {src} | sort | uniq -c | sort -rn | head -3 | awk '{{ print $1, $2 }}' > top_ips.txt
awk '$9 >= 500 && $9 < 600' {src} | wc -l > errors.txt
awk '$9 == 404 {{ print $7 }}' {src} | LC_ALL=C sort -u > not_found.txt
"""
    tests = f"""
def test_top_ips():
    assert lines("top_ips.txt") == {[f"{c} {ip}" for c, ip in top]!r}


def test_errors():
    assert read("errors.txt").strip() == "{n5xx}"


def test_not_found():
    assert lines("not_found.txt") == {p404!r}
"""
    return SynthSpec("logs", instr, sol, tests, files={src: text}, difficulty="medium", tags=("awk", "sort", "uniq"))
