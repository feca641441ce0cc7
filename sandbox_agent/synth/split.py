"""The corpus split by content, written down and checked.

``split.json`` in a corpus dir (written by ``generate``) maps every task id to its split and content key::

    {"version": "content-v1", "tasks": {"synth-chores-s0-00000": {"split": "train", "content_key":
     "chores:0+2+5+7", "family": "chores"}, ...}}

``leaks`` finds the content keys that sit in more than one split (none, when the split is a function of the
key: ``tasks.split_for``). ``sandbox_agent.synth.corpus_entries`` gives a corpus's entries without writing it
(the warm start's SFT corpus, to check that no eval or test key of a bench corpus is among its demonstrations).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from sandbox_agent.tasks import SPLIT_VERSION
from t1async.protocol.errors import ConfigError

SPLIT_FILE = "split.json"
Entry = tuple[str, str, str]  # (split, content key, family)


def write_split_json(root: Path, entries: Mapping[str, Entry]) -> Path:
    """Write (or merge into) ``root/split.json``; the file's path. A file of another split version is
    replaced, not merged."""
    f = Path(root) / SPLIT_FILE
    try:
        old = read_split_json(root) if f.is_file() else {}
    except ConfigError:  # another split version's (or unreadable): its entries no longer hold
        old = {}
    old.update({tid: {"split": s, "content_key": k, "family": fam} for tid, (s, k, fam) in entries.items()})
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": SPLIT_VERSION, "tasks": dict(sorted(old.items()))}, indent=1) + "\n")
    tmp.replace(f)
    return f


def read_split_json(root: Path) -> dict[str, dict]:
    """task id -> {split, content_key, family} from ``root/split.json``."""
    f = Path(root) / SPLIT_FILE
    try:
        doc = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{f}: cannot read the corpus split ({exc}); regenerate the corpus") from exc
    if doc.get("version") != SPLIT_VERSION:
        raise ConfigError(
            f"{f}: split version {doc.get('version')!r}, this code splits by {SPLIT_VERSION!r}; regenerate the corpus"
        )
    return dict(doc["tasks"])


def leaks(entries: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Content key -> its splits (sorted), for every key found in more than one split among ``(split, key)``
    pairs: empty when the splits are disjoint by content."""
    seen: dict[str, set[str]] = {}
    for split, key in entries:
        seen.setdefault(key, set()).add(split)
    return {k: sorted(s) for k, s in sorted(seen.items()) if len(s) > 1}
