"""Train the embedded model's byte-level BPE tokenizer on a generated shell-flavoured corpus.

    python -m t1async.model.train_tokenizer [--vocab-size 4096] [--out t1async/model/assets] [--seed 0]

The corpus is synthesised here, deterministically from ``--seed``: shell commands and prompts, man-page
text, ``ls -l`` listings, CSV and JSON snippets, Python, English task instructions, command output and
ChatML-framed conversations. Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from t1async.model.tokenizer import SPECIAL_TOKENS, ChatTokenizer, assets_dir, chatml_text

WORDS = (
    "the a an of to in for on with from by file files directory line lines output input error test tests "
    "task run runs create write read count find list sort remove copy move print show check fix install "
    "build script command shell user root home data log logs config value values number numbers name names "
    "each all first last new old empty total size date time path paths word words column columns row rows "
    "should must can will that this which when if then not only every into than until after before "
    "returns return exit status code process server port request response json csv table report result "
    "results warning failed passed found missing permission denied option options default usage example"
).split()
CMDS = (
    "ls cat echo grep sed awk find head tail wc sort uniq cut tr mkdir rm cp mv touch chmod chown ps kill "
    "python3 pip git curl tar gzip diff patch make xargs tee date env export cd pwd du df stat file jq "
    "sqlite3 printf test which less more ln basename dirname seq nl paste join comm md5sum sha256sum"
).split()
FLAGS = (
    "-l -la -a -h -n -r -R -v -i -c -f -e -s -u -t -x -p -q -z -k2 -d, -F, -name -type -exec -print0 --help --version"
).split()
EXTS = ".txt .py .csv .json .log .sh .md .conf .yaml .tsv .c .h .db .gz".split()
DIRS = "/tmp /app /home/user /var/log /etc /srv/data /opt/tool /workspace src tests data build out".split()
NAMES = "alice bob carol dave eve frank grace heidi ivan judy mallory oscar peggy trent victor walter".split()


def _fname(r: random.Random) -> str:
    stem = r.choice(WORDS + NAMES + ["main", "utils", "report", "input", "output", "notes", "app"])
    if r.random() < 0.3:
        stem += f"_{r.randint(0, 99)}"
    return stem + r.choice(EXTS)


def _path(r: random.Random) -> str:
    return r.choice(DIRS) + "/" + _fname(r)


def _sentence(r: random.Random, n: int | None = None) -> str:
    ws = [r.choice(WORDS) for _ in range(n or r.randint(5, 16))]
    s = " ".join(ws)
    return s[0].upper() + s[1:] + r.choice([".", ".", ".", ":", "?"])


def _command(r: random.Random) -> str:
    c = r.choice(CMDS)
    parts = [c] + [r.choice(FLAGS) for _ in range(r.randint(0, 2))]
    parts += [
        r.choice([_path(r), _fname(r), f"'{r.choice(WORDS)}'", str(r.randint(0, 500)), "*.txt", "."])
        for _ in range(r.randint(0, 2))
    ]
    cmd = " ".join(parts)
    if r.random() < 0.35:
        cmd += " | " + r.choice(
            ["sort", "uniq -c", "wc -l", "head -n 5", f"grep {r.choice(WORDS)}", "sort -n", "tail -1"]
        )
    if r.random() < 0.15:
        cmd += f" > {_path(r)}"
    return cmd


def _ls(r: random.Random) -> str:
    rows = [f"total {r.randint(0, 400)}"]
    for _ in range(r.randint(2, 9)):
        perm = r.choice(["-rw-r--r--", "drwxr-xr-x", "-rwxr-xr-x", "-rw-------"])
        rows.append(
            f"{perm} 1 {r.choice(NAMES)} {r.choice(NAMES)} {r.randint(0, 99999):>6} "
            f"{r.choice(['Jan', 'Feb', 'Mar', 'Oct', 'Nov'])} {r.randint(1, 28):>2} "
            f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d} {_fname(r)}"
        )
    return "\n".join(rows)


def _csv(r: random.Random) -> str:
    cols = r.sample(["id", "name", "age", "city", "score", "date", "amount", "status", "count"], r.randint(2, 5))
    rows = [",".join(cols)]
    for _ in range(r.randint(2, 8)):
        rows.append(",".join(str(r.randint(0, 999)) if r.random() < 0.6 else r.choice(NAMES) for _ in cols))
    return "\n".join(rows)


def _json_value(r: random.Random) -> str:
    return r.choice([str(r.randint(0, 9999)), "true", "null", chr(34) + r.choice(NAMES) + chr(34)])


def _json(r: random.Random) -> str:
    items = [f'"{r.choice(WORDS)}": {_json_value(r)}' for _ in range(r.randint(1, 5))]
    return "{" + ", ".join(items) + "}" if r.random() < 0.5 else "{\n  " + ",\n  ".join(items) + "\n}"


def _python(r: random.Random) -> str:
    f, v = r.choice(["main", "parse", "count_lines", "load", "solve"]), r.choice(["line", "row", "x", "item"])
    return r.choice(
        [
            f"def {f}(path):\n    with open(path) as fh:\n        for {v} in fh:\n            print({v}.strip())\n",
            f"import sys\n\n\ndef {f}():\n    data = sys.stdin.read().split()\n"
            f"    return sum(int({v}) for {v} in data)\n",
            f"for {v} in range({r.randint(1, 50)}):\n    if {v} % {r.randint(2, 7)} == 0:\n        print({v})\n",
            f"import json\nwith open('{_fname(r)}') as f:\n    obj = json.load(f)\nprint(obj['{r.choice(WORDS)}'])\n",
            f"if __name__ == '__main__':\n    {f}()\n",
        ]
    )


def _man(r: random.Random) -> str:
    c = r.choice(CMDS)
    return (
        f"NAME\n       {c} - {_sentence(r, 6).lower()}\n\nSYNOPSIS\n       {c} [OPTION]... [FILE]...\n\n"
        f"DESCRIPTION\n       {_sentence(r)}\n\n       {r.choice(FLAGS)}\n              {_sentence(r)}\n"
    )


def _output(r: random.Random) -> str:
    return r.choice(
        [
            lambda: "\n".join(f"{r.randint(1, 300):>7} {r.choice(WORDS)}" for _ in range(r.randint(1, 6))),
            lambda: f"bash: {r.choice(CMDS)}: command not found",
            lambda: f"{r.choice(CMDS)}: cannot access '{_path(r)}': No such file or directory",
            lambda: (
                f'Traceback (most recent call last):\n  File "{_fname(r)}", line {r.randint(1, 99)}, in <module>\n'
                f"ValueError: invalid literal for int() with base 10: '{r.choice(WORDS)}'"
            ),
            lambda: "\n".join(_path(r) for _ in range(r.randint(1, 5))),
            lambda: f"{r.randint(0, 5)} passed, {r.randint(0, 5)} failed in {r.random():.2f}s",
            lambda: "",
        ]
    )()


def _snippet(r: random.Random) -> str:
    kind = r.random()
    if kind < 0.30:
        return "$ " + _command(r) + "\n" + _output(r)
    if kind < 0.40:
        return _ls(r)
    if kind < 0.50:
        return _csv(r)
    if kind < 0.58:
        return _json(r)
    if kind < 0.70:
        return _python(r)
    if kind < 0.76:
        return _man(r)
    if kind < 0.88:
        return " ".join(_sentence(r) for _ in range(r.randint(1, 4)))
    return f"```bash\n{_command(r)}\n```"


def _conversation(r: random.Random) -> str:
    turns = [("system", "You are a terminal agent. " + _sentence(r)), ("user", _sentence(r) + " " + _sentence(r))]
    for _ in range(r.randint(1, 4)):
        turns.append(("assistant", f"```bash\n{_command(r)}\n```"))
        turns.append(("tool", _output(r)))
    return chatml_text([{"role": a, "content": b} for a, b in turns], add_generation_prompt=False)


def corpus(seed: int, n_docs: int) -> list[str]:
    r = random.Random(seed)
    return [_conversation(r) if r.random() < 0.25 else _snippet(r) for _ in range(n_docs)]


def train(vocab_size: int, seed: int, n_docs: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed, n_docs), trainer=trainer)
    return tok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m t1async.model.train_tokenizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-size", type=int, default=4096, help="total vocabulary incl. special tokens (default 4096)")
    ap.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    ap.add_argument("--docs", type=int, default=60000, help="number of generated corpus documents (default 60000)")
    ap.add_argument("--max-length", type=int, default=32768, help="model_max_length in tokenizer_config.json")
    ap.add_argument("--out", type=Path, default=assets_dir(), help="output directory (default: the package assets)")
    a = ap.parse_args(argv)
    tok = train(a.vocab_size, a.seed, a.docs)
    ChatTokenizer(tok).save(a.out, model_max_length=a.max_length)
    print(f"wrote {a.out}/tokenizer.json ({tok.get_vocab_size()} tokens) and tokenizer_config.json")


if __name__ == "__main__":
    main()
