"""Live progress for ``cluster up``: one status line from the learner's and actors' metrics.

Every metrics record is also appended to ``<run-dir>/metrics.jsonl``. On a terminal the line is redrawn in
place every second; otherwise (a pipe, a log file) a line is printed every ``every_s`` seconds.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator

import anyio

from t1async.log import get_logger
from t1async.transport import NatsTransport
from t1async.wire import MetricsRecord

log = get_logger("cluster.progress")


def status_line(learner: dict[str, Any] | None, actors: dict[str, dict[str, Any]]) -> str:
    running = sum(int(a.get("episodes_running", 0)) for a in actors.values())
    done = sum(int(a.get("episodes_done", 0)) for a in actors.values())
    a_turns = sum(float(a.get("turns_per_s", 0.0)) for a in actors.values())
    a_tokens = sum(float(a.get("tokens_per_s", 0.0)) for a in actors.values())
    parts = [f"actors {len(actors)}: episodes {running} running {done} done, {a_turns:.2f} turns/s {a_tokens:.0f} tok/s"]
    if learner is None:
        parts.append("learner: waiting for its first metrics")
    else:
        v = learner
        drift = v.get("drift", {})
        parts.append(
            f"policy v{v.get('version', 0)} (step {v.get('step', 0)}), trained {v.get('turns_trained', 0)} turns "
            f"{float(v.get('turns_per_s', 0.0)):.2f}/s | reward {float(v.get('reward_mean', 0.0)):.2f} "
            f"resolved {float(v.get('resolved_rate', 0.0)):.0%} | staleness max {v.get('max_staleness', 0)} "
            f"(η {v.get('eta', '?')}) | drift c/r/f {drift.get('clean', 0)}/{drift.get('realign', 0)}/{drift.get('fork', 0)} "
            f"| {_dlogp(v)}"
        )  # fmt: skip
    return " | ".join(parts)


def _dlogp(v: dict[str, Any]) -> str:
    """T1's mismatch (|Δlogp| on tokens trained by the weights that sampled them) and, apart, the policy's
    own change on stale tokens; '-' when the last step had no such tokens."""
    mm = f"{float(v['mismatch']):.4f}" if int(v.get("mismatch_tokens", 0)) else "-"
    ps = f"{float(v['policy_shift']):.4f}" if int(v.get("policy_shift_tokens", 0)) else "-"
    return f"mismatch {mm} shift {ps}"


@contextmanager
def _ends_line(out: IO[str], tty: bool) -> Iterator[None]:
    """Leave the terminal on a fresh line when the redrawn status line stops."""
    try:
        yield
    finally:
        if tty:
            out.write("\n")
            out.flush()


async def show_progress(nats_url: str, run_dir: Path, *, out: IO[str] = sys.stdout, every_s: float = 10.0) -> None:
    """Runs until cancelled (the supervisor's task group owns it)."""
    learner: dict[str, Any] | None = None
    actors: dict[str, dict[str, Any]] = {}
    tty = out.isatty()
    last = 0.0
    with open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") as sink, _ends_line(out, tty):
        async with NatsTransport(nats_url) as t, t.subscribe("t1.metrics.>") as msgs:
            async for m in msgs:
                rec = m.record
                if not isinstance(rec, MetricsRecord):
                    continue
                body = {"subject": m.subject, "component": rec.component, "step": rec.step, "version": rec.version,
                        "t": time.time(), **rec.values}  # fmt: skip
                sink.write(json.dumps(body, default=str) + "\n")
                sink.flush()
                if rec.component == "learner":
                    learner = {"step": rec.step, "version": rec.version, **rec.values}
                else:
                    actors[m.subject.rsplit(".", 1)[-1]] = dict(rec.values)
                now = time.monotonic()
                if tty:
                    out.write("\r\x1b[2K" + status_line(learner, actors)[: 400])
                    out.flush()
                elif now - last >= every_s:
                    last = now
                    out.write(status_line(learner, actors) + "\n")
                    out.flush()
