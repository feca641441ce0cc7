"""``python -m bench.flatrun``: does a default ``cluster up`` keep its step time flat as its episodes grow?

Runs ``python -m t1async.cluster up --duration S --preset none`` (the quick start's defaults on the bare model,
whose episodes run to 300 turns: the ``learn`` preset a bare ``cluster up`` picks ends each in 4; plus any
``--cluster-arg``) on a fresh run dir, then reads its ``metrics.jsonl``:

- per learner step (each step once): its wall time, its loss tokens (the tokens it trained),
  ``forwarded_per_trained``, and the step time per trained (loss) token;
- ``slope_us_per_token_per_min``: the least-squares slope of step time per trained token over the run's
  minutes, with a 95% interval from a bootstrap over steps. Flat means the interval holds 0 (or the slope is
  small next to the mean: ``slope_share_per_10min``);
- ``turns_per_s_at``: sampled turns per second (the actors' ``turns``) over the minute ending at minutes 1, 5
  and the last one.

    python -m bench.flatrun [--minutes 15] [--run-dir runs/bench/flatrun] [--cluster-arg=--prefix-kv=exact] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench._common import emit_json, print_table


def read_metrics(path: Path) -> tuple[list[dict], list[tuple[float, float]]]:
    """(learner steps, each once, in order; [(t, total turns sampled by all actors)])."""
    steps: dict[int, dict] = {}
    actors: dict[str, int] = {}
    sampled: list[tuple[float, float]] = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the stop
        subject = str(d.get("subject", ""))
        if subject.endswith(".learner") and "t_step_wall_s" in d and "new_tokens" in d:
            steps.setdefault(int(d["step"]), d)
        elif ".actor" in subject and "turns" in d:
            actors[subject] = int(d["turns"])  # each actor's own subject (their component is "actor")
            sampled.append((float(d["t"]), float(sum(actors.values()))))
    return [steps[k] for k in sorted(steps)], sampled


def rate_at(sampled: list[tuple[float, float]], t0: float, minute: float) -> float | None:
    """Turns per second over the minute ending ``minute`` minutes after ``t0``."""
    end, start = t0 + 60 * minute, t0 + 60 * (minute - 1)
    before = [n for t, n in sampled if t <= start]
    upto = [n for t, n in sampled if t <= end]
    if not upto:
        return None
    return ((upto[-1] - (before[-1] if before else 0.0)) / 60.0) if before or minute == 1 else None


def slope(xs: np.ndarray, ys: np.ndarray, rng: np.random.Generator, n_boot: int = 2000) -> tuple[float, float, float]:
    """Least-squares slope and its bootstrap 95% interval."""
    if len(xs) < 3:
        return float("nan"), float("nan"), float("nan")
    s = float(np.polyfit(xs, ys, 1)[0])
    boots = []
    for _ in range(n_boot):
        i = rng.integers(0, len(xs), len(xs))
        if np.ptp(xs[i]) > 0:
            boots.append(float(np.polyfit(xs[i], ys[i], 1)[0]))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return s, float(lo), float(hi)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.flatrun", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0, help="how long cluster up runs (default 15)")
    p.add_argument("--run-dir", type=Path, default=Path("runs/bench/flatrun"), help="emptied first")
    p.add_argument("--cluster-arg", action="append", default=[], help="extra flag for cluster up (repeatable)")
    p.add_argument("--metrics", type=Path, default=None, help="analyse this metrics.jsonl instead of running")
    p.add_argument("--json", action="store_true", help="print the JSON object as the last stdout line")
    a = p.parse_args(argv)
    if a.metrics is None:
        if a.run_dir.exists():
            shutil.rmtree(a.run_dir)
        cmd = [
            sys.executable,
            "-m",
            "t1async.cluster",
            "up",
            "--run-dir",
            str(a.run_dir),
            "--duration",
            str(int(a.minutes * 60)),
            "--plain",
            "--preset",
            "none",  # the long episodes (max-turns 300) whose growth this measures; learn's end in 4 turns
            *a.cluster_arg,
        ]
        print("running:", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            print(f"error: cluster up exited with {rc}; its logs are in {a.run_dir / 'logs'}", file=sys.stderr)
            return 2
        metrics = a.run_dir / "metrics.jsonl"
    else:
        metrics = a.metrics
    steps, sampled = read_metrics(metrics)
    if len(steps) < 3:
        print(f"error: {metrics} holds {len(steps)} learner steps; need 3 or more", file=sys.stderr)
        return 2
    t0 = min([float(s["t"]) for s in steps] + [t for t, _ in sampled])
    mins = np.array([(float(s["t"]) - t0) / 60 for s in steps])
    us = np.array([float(s["t_step_wall_s"]) / max(float(s["loss_tokens"]), 1.0) * 1e6 for s in steps])
    sl, lo, hi = slope(mins, us, np.random.default_rng(0))
    last_min = max(1, int((max(t for t, _ in sampled) - t0) // 60)) if sampled else 0
    marks = sorted({1, 5, last_min} & set(range(1, last_min + 1)))
    res = {
        "minutes": float(mins[-1]),
        "steps": len(steps),
        "step_s_first_last": [float(steps[0]["t_step_wall_s"]), float(steps[-1]["t_step_wall_s"])],
        "step_us_per_trained_mean": float(us.mean()),
        "slope_us_per_token_per_min": sl,
        "slope_ci95": [lo, hi],
        "slope_share_per_10min": 10 * sl / float(us.mean()),
        "forwarded_per_trained_mean": float(
            sum(float(s["forwarded_tokens"]) for s in steps) / max(sum(float(s["new_tokens"]) for s in steps), 1)
        ),
        "turns_per_s_at": {str(m): rate_at(sampled, t0, m) for m in marks},
        "stale_masked_tokens": int(steps[-1].get("stale_masked_tokens", 0) or 0),
        "max_staleness": max(int(s.get("max_staleness", 0) or 0) for s in steps),
        "cluster_args": a.cluster_arg,
    }
    rows = [
        ("learner steps", res["steps"]),
        ("step s, first -> last", f"{res['step_s_first_last'][0]:.1f} -> {res['step_s_first_last'][1]:.1f}"),
        ("step us per trained (loss) token, mean", res["step_us_per_trained_mean"]),
        ("slope, us per token per minute [95% CI]", f"{sl:.2f} [{lo:.2f}, {hi:.2f}]"),
        ("slope over 10 minutes / mean", res["slope_share_per_10min"]),
        ("forwarded per trained position", res["forwarded_per_trained_mean"]),
        ("sampled turns/s at minutes " + ", ".join(res["turns_per_s_at"]), str(res["turns_per_s_at"])),
        ("max staleness / stale-masked tokens", f"{res['max_staleness']} / {res['stale_masked_tokens']}"),
    ]
    print_table("bench.flatrun", rows)
    if a.json:
        emit_json(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
