"""bench.learning's arithmetic and figure: per-task (or per content key) scores, the paired before/after
comparison, the warm start's best decoding, the spread over seeds, episode errors, the split check, the
learning curve read from a run's ``metrics.jsonl``, and ``learning.png``. Means, CIs and the paired
difference are ``t1async.eval.stats``'s by content key (``paired_by_key``); episodes that errored are counted
apart (``t1async.eval.stats.split_errors``), never as the policy's failures."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from sandbox_agent.synth.split import leaks, split_of
from t1async.eval.stats import EPISODE_ERRORS, key_means, paired_by_key, split_errors


def per_task(rows: Sequence[Mapping], by_key: str = "task") -> dict[str, tuple[float, float]]:
    """task (or the rows' ``by_key`` value, e.g. ``content_key``) -> (share of its episodes resolved, mean
    tests passed)."""
    by: dict[str, list[Mapping]] = {}
    for r in rows:
        by.setdefault(str(r.get(by_key) or r["task"]), []).append(r)
    return {
        t: (float(np.mean([e["resolved"] for e in es])), float(np.mean([e["tests_passed"] for e in es])))
        for t, es in by.items()
    }


def column(scores: dict[str, tuple[float, float]], idx: int) -> dict[str, float]:
    """task -> one of ``per_task``'s values (0: share resolved, 1: mean tests passed)."""
    return {t: s[idx] for t, s in scores.items()}


def learning_curve(metrics: Path) -> list[dict]:
    """Per learner step: reward per trained turn, mean |Δlogp|, and the resolved share of the episodes the
    actors finished between the previous step and this one (from the actors' cumulative counters, by time)."""
    steps: dict[int, dict] = {}
    deltas: list[tuple[float, int, int, int]] = []  # (t, episodes, resolved, tests) ended since the last report
    last: dict[str, tuple[int, int, int]] = {}  # actor -> (episodes_done, resolved, tests_passed) seen so far
    if not metrics.is_file():
        return []
    for line in metrics.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m.get("component") == "learner" and m.get("step", 0) >= 1 and "reward_sum" in m:
            if int(m["step"]) not in steps:  # the first report of a step is when it finished
                steps[int(m["step"])] = {
                    "step": int(m["step"]),
                    "t": float(m.get("t", 0.0)),
                    "reward_per_turn": m["reward_sum"] / max(1, m["turns"]),
                    "mean_abs_dlogp": float(m.get("mean_abs_dlogp", float("nan"))),
                    "loss": float(m.get("loss", float("nan"))),
                }
        elif m.get("component") == "actor" and "episodes_done" in m:
            a = str(m.get("subject", ""))
            cur = (int(m["episodes_done"]), int(m["resolved"]), int(m["tests_passed"]))
            prev = last.get(a, (0, 0, 0))
            if cur[0] > prev[0]:
                deltas.append((float(m.get("t", 0.0)), cur[0] - prev[0], cur[1] - prev[1], cur[2] - prev[2]))
            last[a] = cur
    rows = [steps[s] for s in sorted(steps)]
    for i, row in enumerate(rows):
        lo = rows[i - 1]["t"] if i else float("-inf")
        got = [d for d in deltas if lo < d[0] <= row["t"]]
        n = sum(d[1] for d in got)
        row["episodes"] = n
        row["resolved_rate"] = sum(d[2] for d in got) / n if n else float("nan")
        row["tests_per_episode"] = sum(d[3] for d in got) / n if n else float("nan")
    return rows


def plot(curve: list[dict], table: dict, path: Path, *, held_title: str = "held out") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    xs = [r["step"] for r in curve]
    ax[0].plot(xs, [r["reward_per_turn"] for r in curve], label="reward / trained turn")
    ax[0].plot(xs, [r["resolved_rate"] for r in curve], "o-", ms=3, label="resolved (episodes ended at v-1)")
    ax[0].set_xlabel("learner step")
    ax[0].legend()
    ax[0].set_title("training")
    ax[1].plot(xs, [r["mean_abs_dlogp"] for r in curve])
    ax[1].axhline(0.02, color="r", ls="--", label="bound 0.02")
    ax[1].set_xlabel("learner step")
    ax[1].set_title("mean |Δlogp| sampler vs learner")
    ax[1].legend()
    names = ["pass@1", "tests/4"]
    for _j, (who, off) in enumerate((("before", -0.2), ("after", 0.2))):
        vals = [table[who]["pass1"]["mean"], table[who]["tests"]["mean"] / 4]
        err = [
            [v - lo for v, lo in zip(vals, (table[who]["pass1"]["ci95"][0], table[who]["tests"]["ci95"][0] / 4))],
            [hi - v for v, hi in zip(vals, (table[who]["pass1"]["ci95"][1], table[who]["tests"]["ci95"][1] / 4))],
        ]
        ax[2].bar(np.arange(2) + off, vals, 0.4, yerr=err, label=who, capsize=3)
    ax[2].set_xticks(range(2), names)
    ax[2].set_title(held_title)
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def keys_of(*evals: Sequence[Mapping]) -> dict[str, str]:
    """task -> its content key (the task itself when a row has none), from episode rows."""
    return {str(r["task"]): str(r.get("content_key") or r["task"]) for rows in evals for r in rows}


def compare(before: Sequence[Mapping], after: Sequence[Mapping]) -> dict:
    """Before vs after on the same tasks: pass@1 and mean tests passed (means over content keys, every key
    weighing the same: the tasks of one key are one held-out item, not independent draws) and the paired
    difference by key (``t1async.eval.stats.paired_by_key``: its 95% cluster bootstrap CI, keys resampled and
    widened for their small number, and the sign-flip permutation p over keys, ``p_diff``). Errored episodes
    are left out of both sides."""
    key_of = keys_of(before, after)
    b, a = (per_task(split_errors(rows)[0]) for rows in (before, after))
    d = {k: paired_by_key(column(b, i), column(a, i), key_of) for i, k in enumerate(("pass1", "tests"))}

    def by_key(s: dict[str, tuple[float, float]], i: int) -> float:
        return float(np.mean(list(key_means(column(s, i), key_of).values()))) if s else float("nan")

    return {
        "pass1_before": by_key(b, 0),
        "pass1_after": by_key(a, 0),
        "tests_before": by_key(b, 1),
        "tests_after": by_key(a, 1),
        "diff": {"pass1": d["pass1"]["mean"], "tests": d["tests"]["mean"]},
        "ci95_diff": {"pass1": d["pass1"]["ci95"], "tests": d["tests"]["ci95"]},
        "p_diff": {"pass1": d["pass1"]["p"], "tests": d["tests"]["p"]},
        "keys": d["pass1"]["keys"],
    }


def pass1(rows: Sequence[Mapping]) -> float:
    """pass@1 of an eval's rows: the mean over content keys of their share resolved (errors left out)."""
    scores = per_task(split_errors(rows)[0], by_key="content_key")
    return float(np.mean(list(column(scores, 0).values()))) if scores else float("nan")


def best_decoding(sweep: dict[float, float]) -> tuple[float, float]:
    """(temperature, pass@1) of the best entry of a temperature -> pass@1 sweep; a tie goes to the lower
    temperature, a NaN (nothing scored) never wins."""
    ok = {t: p for t, p in sweep.items() if np.isfinite(p)}
    if not ok:
        raise ValueError(f"no temperature of the sweep scored anything: {sweep}")
    t = min(ok, key=lambda x: (-ok[x], x))
    return t, ok[t]


def spread(values: Sequence[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max over seeds."""
    v = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(v.mean()),
        "sd": float(v.std(ddof=1)) if v.size > 1 else 0.0,
        "min": float(v.min()),
        "max": float(v.max()),
        "n": int(v.size),
    }


def error_counts(evals: Mapping[str, Sequence[Mapping]]) -> dict:
    """Episode errors by kind over every eval (``total``, with ``episodes``: all episodes run) and per eval."""
    total = {**dict.fromkeys(EPISODE_ERRORS, 0), "episodes": 0}
    by: dict[str, dict[str, int]] = {}
    for name, rows in evals.items():
        _, errs = split_errors(rows)
        by[name] = {k: n for k, n in errs.items() if n}
        for k, n in errs.items():
            total[k] += n
        total["episodes"] += len(rows)
    return {"total": total, "by_eval": by}


def split_check(
    corpus: dict[str, dict], sft: dict[str, tuple[str, str, str]], *, fold: int | None = None, folds: int = 0
) -> dict:
    """Is the bench's corpus (``split.json``'s tasks: id -> {split, content_key}) disjoint by content, and
    does no eval or test key of it appear among the warm start's demonstrations (``sft``: the train entries
    of its corpus, ``sandbox_agent.synth.corpus_entries``)? Also that every task's split is its key's (in fold
    ``fold`` of ``folds``: ``sandbox_agent.synth.split.split_of``)."""
    pairs = [(e["split"], e["content_key"]) for e in corpus.values()]
    pairs += [("train", key) for split, key, _ in sft.values() if split == "train"]
    found = leaks(pairs)
    wrong = sorted(t for t, e in corpus.items() if e["split"] != split_of(e["content_key"], fold=fold, folds=folds))
    keys: dict[str, set[str]] = {}
    for e in corpus.values():
        keys.setdefault(e["split"], set()).add(e["content_key"])
    return {
        "split_disjoint": not found and not wrong,
        "leaks": dict(list(found.items())[:20]),
        "wrong_split": wrong[:20],
        "task_counts": {s: sum(1 for e in corpus.values() if e["split"] == s) for s in sorted(keys)},
        "keys": {s: len(k) for s, k in sorted(keys.items())},
        "sft_train_tasks": sum(1 for s, _, _ in sft.values() if s == "train"),
    }
