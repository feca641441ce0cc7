"""The corpus split by content, written down and checked.

``split.json`` in a corpus dir (written by ``generate``) maps every task id to its split and content key::

    {"version": "content-v1", "tasks": {"synth-chores-s0-00000": {"split": "train", "content_key":
     "chores:0+2+5+7", "family": "chores"}, ...}}

``split_of`` is the split of a key: ``tasks.split_for``'s hash, except that a family's OOD keys
(``OOD_PREFIXES``: ``choresn``'s held-out n, ``observe``'s held-out variant) are test keys whatever their
hash, and, with folds (``fold`` of ``folds``, ``bench.learning --folds``), a salted hash per fold plus one fold
kept untouched: ``UNTOUCHED_PERCENT`` of the keys (by a hash of their own) are set aside, in no split of folds
0 .. folds - 1, and are the test keys of fold ``folds`` (the untouched one, run last and reported apart).

``leaks`` finds the content keys that sit in more than one split (none, when the split is a function of the
key: ``tasks.split_for``). ``sandbox_agent.synth.corpus_entries`` gives a corpus's entries without writing it
(the warm start's SFT corpus, to check that no eval or test key of a bench corpus is among its demonstrations).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from sandbox_agent.synth.choresn import OOD_PREFIX as CHORESN_OOD
from sandbox_agent.synth.observe import OOD_PREFIX as OBSERVE_OOD
from sandbox_agent.tasks.task import SPLIT_VERSION, Split, split_for
from t1async.protocol.errors import ConfigError

SPLIT_FILE = "split.json"
Entry = tuple[str, str, str]  # (split, content key, family)
OOD_PREFIXES: tuple[str, ...] = (CHORESN_OOD, OBSERVE_OOD)  # keys that are test keys in every split
UNTOUCHED_PERCENT = 10  # with folds: this share of keys is the untouched fold's test set, and in no other fold


def split_of(key: str, *, fold: int | None = None, folds: int = 0) -> Split | None:
    """The split of content key ``key``: ``split_for(key)`` with no fold (an OOD key: always test); with
    ``fold`` in 0 .. ``folds`` the fold's own, from a hash salted by the fold, the keys set aside for the
    untouched fold (``fold == folds``) being its test keys and None (in no split: never read) in the others."""
    salt = ""
    if fold is not None:
        if not 0 <= fold <= folds:
            raise ConfigError(f"fold {fold} of {folds}: give 0 <= fold <= folds (fold {folds} is the untouched one)")
        h = int.from_bytes(hashlib.sha256(f"untouched/{key}".encode()).digest()[:8], "big") % 100
        if h < UNTOUCHED_PERCENT:
            return "test" if fold == folds else None
        salt = f"fold{fold}/"
    if key.startswith(OOD_PREFIXES):  # the untouched fold's test keys are the set-aside ones only
        return None if fold is not None and fold == folds else "test"
    s = split_for(salt + key)
    return "train" if fold is not None and fold == folds and s == "test" else s  # untouched: set-aside keys only


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
