"""Live progress for ``cluster up``: the dashboard (``dashboard.py``) fed from NATS and the samplers.

Every metrics record is also appended to ``<run-dir>/metrics.jsonl``. On a terminal a rich ``Live`` redraws
the dashboard every second and fits the terminal's width (long lines wrap, nothing is left behind);
otherwise (a pipe, a log file, or ``--plain``) one compact line is printed every ``every_s`` seconds.
Set-up steps that take minutes (task synthesis, the warm start) show a progress bar on a terminal.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import anyio
import httpx
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from t1async.cluster.observe.dashboard import RunView, plain_line, render
from t1async.log import get_logger
from t1async.protocol.wire import MetricsRecord
from t1async.transport import NatsConfig, NatsTransport

log = get_logger("cluster.progress")


def sampler_state(resp: httpx.Response | None, error: str = "") -> tuple[str, int | None]:
    """("ok" or why not, requests in flight or None) from a /get_server_info answer."""
    if resp is None:
        return f"unreachable ({error})", None
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}", None
    try:
        states = resp.json().get("internal_states") or [{}]
        running = states[0].get("running_requests", states[0].get("#running-req"))
    except (ValueError, AttributeError, IndexError):
        return "ok", None
    return "ok", int(running) if isinstance(running, (int, float)) else None


async def _poll_samplers(view: RunView, every_s: float, api_key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=2.0, headers=headers) as client:
        while True:
            for url, s in view.samplers.items():
                try:
                    resp = await client.get(f"{url}/get_server_info")
                    if resp.status_code == 404:  # vLLM has no /get_server_info: its /health says it is up
                        resp = await client.get(f"{url}/health")
                    state, running = sampler_state(resp)
                except httpx.HTTPError as exc:
                    state, running = sampler_state(None, type(exc).__name__)
                s.record(view.clock(), state, running)
            await anyio.sleep(every_s)


async def _poll_nats_health(view: RunView, monitor_url: str, every_s: float) -> None:
    """The embedded nats-server's /healthz (JetStream included), as the NATS line's state."""
    async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
        while True:
            try:
                resp = await client.get(f"{monitor_url}/healthz?js-enabled-only=true")
                view.nats_state = "healthy" if resp.status_code == 200 else f"unhealthy (HTTP {resp.status_code})"
            except httpx.HTTPError as exc:
                view.nats_state = f"monitor unreachable ({type(exc).__name__})"
            await anyio.sleep(every_s)


async def _watch_metrics(t: NatsTransport, view: RunView, sink: IO[str]) -> None:
    async with t.subscribe("t1.metrics.>") as msgs:
        async for m in msgs:
            rec = m.record
            if not isinstance(rec, MetricsRecord):
                continue
            body = {
                "subject": m.subject,
                "component": rec.component,
                "step": rec.step,
                "policy_version": rec.policy_version,
                "t": time.time(),
                **rec.values,
            }
            sink.write(json.dumps(body, default=str) + "\n")
            sink.flush()
            view.on_metrics(rec.component, m.subject.rsplit(".", 1)[-1], rec.step, rec.policy_version, dict(rec.values))


async def _watch_traj(t: NatsTransport, view: RunView) -> None:
    async with t.subscribe("t1.traj.>", include_malformed=True) as msgs:
        async for m in msgs:
            view.on_traj(len(m.data))


async def show_progress(
    nats_url: str,
    run_dir: Path,
    *,
    sampler_urls: Sequence[str] = (),
    sampler_api_key: str | None = None,
    out: IO[str] | None = None,
    plain: bool = False,
    every_s: float = 10.0,
    refresh_s: float = 1.0,
    nats_creds: Path | None = None,
) -> None:
    """Runs until cancelled (the supervisor's task group owns it). ``nats_creds``: the reader's."""
    out = out or sys.stdout
    view = RunView(str(run_dir), nats_url, sampler_urls)
    live_mode = out.isatty() and not plain
    with open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8") as sink:
        nats = NatsConfig(url=nats_url, creds=nats_creds)
        async with NatsTransport(config=nats) as t, anyio.create_task_group() as tg:
            view.nats_state = "connected"
            tg.start_soon(_watch_metrics, t, view, sink)
            tg.start_soon(_watch_traj, t, view)
            if view.samplers:
                tg.start_soon(_poll_samplers, view, min(refresh_s * 2, 2.0), sampler_api_key)
            monitor = _monitor_url(run_dir)
            if monitor:
                tg.start_soon(_poll_nats_health, view, monitor, 5.0)
            if live_mode:
                console = Console(file=out)
                # redrawn from this task only: no rich refresh thread outside the task group
                with _no_echo(out), Live(render(view), console=console, auto_refresh=False) as live:
                    while True:
                        await anyio.sleep(refresh_s)
                        live.update(render(view), refresh=True)
            else:
                while True:
                    await anyio.sleep(every_s)
                    out.write(plain_line(view) + "\n")
                    out.flush()


@contextmanager
def _no_echo(out: IO[str]) -> Iterator[None]:
    """Keys typed while the dashboard is drawn are not echoed: the terminal's "^C" echo of Ctrl-C moved the
    cursor under rich, and the last frame landed a line low, leaving a stale line behind."""
    try:
        import termios

        fd = out.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):  # not a real terminal (or not POSIX)
        yield
        return
    changed = list(saved)
    changed[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
    termios.tcsetattr(fd, termios.TCSANOW, changed)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _monitor_url(run_dir: Path) -> str:
    """The embedded nats-server's monitoring URL from cluster.json ('' for an external NATS or no state)."""
    from t1async.cluster.state import ClusterState
    from t1async.protocol.errors import ConfigError

    try:
        return ClusterState.load(run_dir).monitor_url
    except ConfigError:
        return ""


# ------------------------------------------------------------------------------------------ set-up bars


def _bar_columns() -> list:
    return [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]


@contextmanager
def setup_bar(description: str, total: int | None, *, out: IO[str] | None = None) -> Iterator[Callable[[int], None]]:
    """A progress bar for a long set-up step, on a terminal only (callers print their own plain lines).
    Yields ``bar(completed)``; a bar with no total is a spinner."""
    out = out or sys.stdout
    if not out.isatty():
        yield lambda completed: None
        return
    with Progress(*_bar_columns(), console=Console(file=out), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda completed: progress.update(task, completed=completed)


@contextmanager
def phase_bars(
    job: str, phases: Sequence[tuple[str, str, int | None]], *, out: IO[str] | None = None
) -> Iterator[Callable[[str, int, int | None], None]]:
    """Progress bars for a one-shot job's phases, ``(label, log event, total)``, one row each, on a terminal;
    elsewhere (``--plain``, a pipe) a line per phase at its start and at every tenth of it. Yields
    ``bar(event, completed, total)``: ``total`` fills in a phase whose total was None (the log's record says)."""
    out = out or sys.stdout
    labels = {event: label for label, event, _ in phases}
    totals: dict[str, int | None] = {event: total for _, event, total in phases}
    if not out.isatty():
        shown: dict[str, int] = {}

        def line(event: str, completed: int, total: int | None) -> None:
            if event not in labels:
                return
            total = totals[event] = totals[event] or total
            tenth = completed * 10 // total if total else completed // 50
            if shown.get(event) != tenth:
                shown[event] = tenth
                of = f"/{total}" if total else ""
                print(f"{job}: {labels[event]} {completed}{of}", file=out, flush=True)

        yield line
        return
    with Progress(*_bar_columns(), console=Console(file=out), transient=True) as progress:
        rows = {event: progress.add_task(f"{job}: {label}", total=total) for label, event, total in phases}

        def update(event: str, completed: int, total: int | None) -> None:
            if event in rows:
                totals[event] = totals[event] or total
                progress.update(rows[event], completed=completed, total=totals[event])

        yield update


async def watch_log_steps(log_path: Path, bars: Callable[[str, int, int | None], None], poll_s: float = 0.5) -> None:
    """For each line of a JSON-lines log whose ``event`` ``bars`` knows and that has an integer ``step`` (counting
    from 0), call ``bars(event, step + 1, its total or None)``, until cancelled."""
    pos = 0
    while True:
        try:
            with open(log_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        end = chunk.rfind(b"\n") + 1
        pos += end
        for raw in chunk[:end].splitlines():
            if b'"step"' not in raw:
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec.get("event"), str) and isinstance(rec.get("step"), int):
                total = rec.get("total")
                bars(rec["event"], rec["step"] + 1, total if isinstance(total, int) else None)
        await anyio.sleep(poll_s)
