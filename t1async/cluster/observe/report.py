"""``cluster report``: one page that pictures a run, from ``<run-dir>/metrics.jsonl``.

Six panels: reward and resolved rate, throughput (turns/s sampled by the actors and trained by the
learner), the staleness histogram of trained tokens, TITO drift counts (clean / realign / fork), the
train/inference mismatch and the policy shift, and the learner's step time split into forward, backward,
checkpoint and push. Writes a PNG (matplotlib, no display needed) and an HTML page that embeds it with the
run's headline numbers. A panel with nothing to show says so instead of drawing zeros.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from t1async.protocol.errors import ConfigError


@dataclass
class RunSeries:
    """The metrics of one run, arranged for plotting (times in seconds since the first record)."""

    t0: float = 0.0
    learner: list[dict[str, Any]] = field(default_factory=list)  # every learner record, in order
    steps: list[dict[str, Any]] = field(default_factory=list)  # the first record of each new step
    actor_turns: list[tuple[float, float]] = field(default_factory=list)  # (t, turns summed over actors)
    actors: dict[str, dict[str, Any]] = field(default_factory=dict)  # last record of each actor


def load(path: Path) -> RunSeries:
    """Read a metrics.jsonl; a torn last line (a crash mid-write) is skipped, any other bad line is an error."""
    try:
        raw = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; `cluster up` writes it into its --run-dir") from None
    recs = []
    for i, line in enumerate(raw):
        if not line.strip():
            continue
        try:
            recs.append(json.loads(line))
        except ValueError:
            if i == len(raw) - 1:
                continue
            raise ConfigError(f"{path}:{i + 1}: not a JSON line; is this a metrics.jsonl?") from None
    if not recs:
        raise ConfigError(f"{path} holds no records yet: let the run go until the learner reports (a few seconds)")
    rs = RunSeries(t0=min(float(r.get("t", 0.0)) for r in recs))
    last_step = None
    for r in recs:
        t = float(r.get("t", rs.t0)) - rs.t0
        if r.get("component") == "learner":
            rs.learner.append({**r, "t": t})
            if r.get("step") != last_step and r.get("step", 0) > 0 and "t_step_s" in r:
                rs.steps.append({**r, "t": t})
                last_step = r.get("step")
        elif r.get("component") == "actor":
            rs.actors[str(r.get("subject", ""))] = r
            rs.actor_turns.append((t, sum(float(a.get("turns", 0)) for a in rs.actors.values())))
    return rs


def _rate(points: list[tuple[float, float]], window_s: float = 30.0) -> tuple[list[float], list[float]]:
    """Rate of a cumulative counter over a trailing window, at each point."""
    ts, rs = [], []
    j = 0
    for t, v in points:
        while points[j][0] < t - window_s:
            j += 1
        t_a, v_a = points[j]
        if t - t_a > 0:
            ts.append(t)
            rs.append((v - v_a) / (t - t_a))
    return ts, rs


def _nothing(ax: Any, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4")


def render_png(rs: RunSeries, out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9), dpi=100)
    (a_rew, a_thr, a_stale), (a_drift, a_mm, a_step) = axes
    fig.suptitle(title or "t1async run", fontsize=14)
    minutes = lambda xs: [x / 60 for x in xs]  # noqa: E731

    with_rew = [r for r in rs.learner if "reward_mean" in r]
    a_rew.set_title("reward (tests passed) and resolved rate, over ended episodes")
    if with_rew:
        a_rew.plot(minutes([r["t"] for r in with_rew]), [r["reward_mean"] for r in with_rew], label="reward mean")
        a_rew.set_ylabel("tests passed")
        a_rew.set_xlabel("minutes")
        ax2 = a_rew.twinx()
        ax2.plot(
            minutes([r["t"] for r in with_rew]), [r["resolved_rate"] for r in with_rew], color="C2", label="resolved"
        )
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("resolved rate")
        a_rew.legend(loc="upper left")
        ax2.legend(loc="upper right")
    else:
        _nothing(a_rew, "no episode has ended yet")

    a_thr.set_title("throughput (turns/s, 30 s window)")
    t_a, r_a = _rate(rs.actor_turns)
    t_l, r_l = _rate([(r["t"], float(r.get("turns_trained", 0))) for r in rs.learner])
    if r_a or r_l:
        a_thr.plot(minutes(t_a), r_a, label="sampled (actors)")
        a_thr.plot(minutes(t_l), r_l, label="trained (learner)")
        a_thr.set_xlabel("minutes")
        a_thr.legend()
    else:
        _nothing(a_thr, "fewer than two records")

    last = rs.learner[-1] if rs.learner else {}
    hist = {int(k): int(v) for k, v in (last.get("staleness_hist") or {}).items()}
    a_stale.set_title(f"staleness of trained tokens (η = {last.get('eta', '–')})")
    if hist:
        ks = sorted(hist)
        a_stale.bar([str(k) for k in ks], [hist[k] for k in ks], color="C4")
        a_stale.set_xlabel("policy versions between sampling and training")
        a_stale.set_ylabel("tokens")
    else:
        _nothing(a_stale, "nothing trained yet")

    a_drift.set_title("TITO drift at turn boundaries (cumulative)")
    with_drift = [r for r in rs.learner if isinstance(r.get("drift"), dict)]
    if with_drift:
        for k, c in (("clean", "C2"), ("realign", "C1"), ("fork", "C3")):
            a_drift.plot(
                minutes([r["t"] for r in with_drift]), [r["drift"].get(k, 0) for r in with_drift], label=k, color=c
            )
        a_drift.set_yscale("symlog")
        a_drift.set_xlabel("minutes")
        a_drift.legend()
    else:
        _nothing(a_drift, "no boundaries checked yet")

    a_mm.set_title("|Δlogp| learner vs sampler, per step")
    mm = [(s["step"], s["mismatch"]) for s in rs.steps if s.get("mismatch_tokens", 0) > 0]
    ps = [(s["step"], s["policy_shift"]) for s in rs.steps if s.get("policy_shift_tokens", 0) > 0]
    if mm or ps:
        if mm:
            a_mm.plot(*zip(*mm), "o-", label="mismatch (same version)")
        if ps:
            a_mm.plot(*zip(*ps), "s-", label="policy shift (stale tokens)")
        a_mm.set_xlabel("step")
        a_mm.legend()
    else:
        _nothing(a_mm, "no step measured it yet")

    a_step.set_title("learner step time")
    parts = [
        ("t_forward_s", "forward"),
        ("t_backward_s", "backward"),
        ("t_checkpoint_s", "checkpoint"),
        ("t_push_s", "push"),
    ]
    steps = [s for s in rs.steps if all(k in s for k, _ in parts)]
    if steps:
        xs = [s["step"] for s in steps]
        bottom = [0.0] * len(steps)
        for k, name in parts:
            ys = [float(s[k]) for s in steps]
            a_step.bar(xs, ys, bottom=bottom, label=name)
            bottom = [b + y for b, y in zip(bottom, ys)]
        a_step.set_xlabel("step")
        a_step.set_ylabel("seconds")
        a_step.legend()
    else:
        _nothing(a_step, "no step with a time split yet")

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def headline(rs: RunSeries) -> dict[str, Any]:
    """The few numbers a reader wants first (absent ones are absent, not 0)."""
    last = rs.learner[-1] if rs.learner else {}
    out: dict[str, Any] = {
        "duration_min": round((last.get("t", 0.0)) / 60, 1) if last else None,
        "policy_version": last.get("policy_version"),
        "steps": last.get("step"),
        "turns_trained": last.get("turns_trained"),
        "episodes_ended": last.get("episodes_ended"),
        "max_staleness": last.get("max_staleness"),
        "eta": last.get("eta"),
    }
    for k in ("reward_mean", "resolved_rate"):
        if k in last:
            out[k] = round(float(last[k]), 4)
    if rs.steps:
        out["mean_step_s"] = round(
            sum(float(s.get("t_step_wall_s", s.get("t_step_s", 0))) for s in rs.steps) / len(rs.steps), 2
        )
    return {k: v for k, v in out.items() if v is not None}


def render_html(rs: RunSeries, png: Path, out: Path, title: str) -> Path:
    img = base64.b64encode(png.read_bytes()).decode()
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in headline(rs).items())
    out.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}th,td{padding:2px 10px;"
        "text-align:left;border-bottom:1px solid #ddd}img{max-width:100%}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><table>{rows}</table>"
        f"<img alt='run report' src='data:image/png;base64,{img}'></body></html>",
        encoding="utf-8",
    )
    return out


def report(run_dir: Path, out: Path | None = None) -> tuple[Path, Path, dict[str, Any]]:
    """Write ``<out or run-dir/report>.png`` and ``.html``; returns their paths and the headline numbers."""
    run_dir = Path(run_dir)
    rs = load(run_dir / "metrics.jsonl")
    base = Path(out) if out is not None else run_dir / "report"
    base = base.with_suffix("") if base.suffix in (".png", ".html") else base
    title = f"t1async run {run_dir}"
    png = render_png(rs, base.with_suffix(".png"), title)
    page = render_html(rs, png, base.with_suffix(".html"), title)
    return png, page, headline(rs)
