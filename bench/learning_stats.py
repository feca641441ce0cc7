"""bench.learning's arithmetic and figure: per-task scores, the learning curve read from a run's
``metrics.jsonl``, and ``learning.png``. Means, CIs and the paired before/after difference are
``t1async.eval.stats``'s (``mean_ci``, ``paired_diff``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def per_task(rows: Sequence[dict]) -> dict[str, tuple[float, float]]:
    """task -> (share of its episodes resolved, mean tests passed)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["task"], []).append(r)
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


def plot(curve: list[dict], table: dict, path: Path) -> None:
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
    ax[2].set_title("held-out eval split")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
