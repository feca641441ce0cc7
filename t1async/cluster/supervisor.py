"""``cluster up``: start the components in order, record their PIDs, stop them all on Ctrl-C/SIGTERM/--duration.

Components are processes described by ``ProcessSpec`` (argv, env). NATS comes first (embedded
nats-server unless ``nats_url`` points at an external one); the others are started in the order given,
each in its own session with stdout/stderr in ``<run-dir>/logs/<name>.log``, and each knows the NATS URL
through ``T1_NATS_URL``. Stopping is the reverse: every component gets SIGTERM, then SIGKILL after
``stop_timeout_s``; NATS stops last. If a component exits on its own the whole cluster stops (exit 1).
Every child carries a parent-death signal (t1async/procs.py): a SIGKILLed supervisor takes them along, and
the next ``up`` on the run dir reaps by PID whatever it recorded and still runs (design §9).

To add components (sampler, actors, learner): build more ``ProcessSpec`` in ``component_specs``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from t1async.cluster.state import ClusterState, RunStatus, is_ours, proc_info, reap_stale
from t1async.log import get_logger
from t1async.procs import ChildProcess, open_process
from t1async.protocol.errors import ConfigError, ServerStartError
from t1async.signals import STOP, next_signal, receive, set_handlers

log = get_logger("cluster")


EXIT_CONFIG = 2  # a component that exits 2 said what is wrong (a T1Error's one line): restarting cannot help


def last_line(path: Path) -> str:
    """The last non-empty line of a component's log (its one-line error when it exited 2)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    ready_file: Path | None = None  # the next component starts only once this file exists
    ready_timeout_s: float = 300.0
    finishes: bool = False  # exiting with 0 is the cluster's normal end (the learner with --steps)
    # a one-shot job: its phases, each a progress bar moved by one log event's ``step``: (label, event, total;
    # None: the event's own ``total``), and what to say when it starts (default: that it runs, and its log)
    progress: tuple[tuple[str, str, int | None], ...] = ()
    note: str = ""
    restart: bool = False  # dying restarts it (same argv), within ClusterConfig.max_restarts, instead of
    # stopping the cluster (the learner resumes from its checkpoint, an actor's episodes end on its restart)


@dataclass(frozen=True)
class ClusterConfig:
    run_dir: Path
    nats_url: str | None = None  # an external NATS; None starts the embedded nats-server
    nats_port: int = 0  # 0: a free loopback port
    nats_nodes: int = 1  # >1: an embedded JetStream cluster of this many nodes (transport/natscluster.py)
    stream_replicas: int | None = None  # create/scale the T1 streams to this many replicas; None: as they are
    nats_auth: bool = False  # the embedded NATS takes only the users in <run-dir>/secrets (transport/auth.py)
    nats_tls: bool = False  # ... over TLS, with a CA and server certificate made in <run-dir>/secrets
    nats_creds: Path | None = None  # an external NATS's credentials, for the stream setup
    max_payload: int = 8 << 20
    duration_s: float | None = None  # None: until Ctrl-C / SIGTERM / `down`
    stop_timeout_s: float = 10.0
    max_restarts: int = 5  # restarts of one component within restart_window_s; one more death stops the run
    restart_window_s: float = 600.0
    components: tuple[ProcessSpec, ...] = ()
    build: Callable[[str], Sequence[ProcessSpec]] | None = None  # more components, given the NATS URL
    before: tuple[ProcessSpec, ...] = ()  # one-shot jobs run to completion before NATS (e.g. warm start)
    # shows live progress, given the NATS URL (a coroutine function: it is started in the task group)
    progress: Callable[[str, Path], Coroutine[Any, Any, None]] | None = None


def component_specs(config: ClusterConfig, nats_url: str) -> list[ProcessSpec]:
    """The processes to start after NATS, in order."""
    return list(config.components) + list(config.build(nats_url) if config.build else ())


class Supervisor:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.state = ClusterState(run_dir=str(config.run_dir))
        self.failed: str | None = None
        self.finished: str | None = None
        self._restarts: defaultdict[str, list[float]] = defaultdict(list)  # name -> monotonic restart times

    async def run(self) -> int:
        """Run the cluster in the foreground; returns the exit status (0 clean stop, 1 a component died)."""
        run_dir = Path(self.config.run_dir)
        self._refuse_if_running(run_dir)
        # an earlier supervisor of this run dir that was SIGKILLed may have left components (and with them
        # the NATS store's lock, the sampler's port): stop them by PID first (design §9)
        for line in await anyio.to_thread.run_sync(reap_stale, run_dir, self.config.stop_timeout_s):
            print(f"reaped what an earlier cluster left running: {line}", flush=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.state.supervisor = proc_info("supervisor", os.getpid())
        self.state.save()
        # a closed terminal (SIGHUP) must not kill the supervisor while its components run in their own
        # sessions: they would be orphaned. It is ignored while starting and stopping, a stop request between.
        saved = set_handlers({signal.SIGHUP: signal.SIG_IGN})
        try:
            for job in self.config.before:
                await self._run_oneshot(job)
            async with AsyncExitStack() as stack:
                nats_url, auth, admin = self.config.nats_url, None, self.config.nats_creds
                if nats_url is None and (self.config.nats_auth or self.config.nats_tls):
                    from t1async.transport.auth import Role, creds_path, make_server_auth, secrets_dir

                    auth = make_server_auth(secrets_dir(run_dir), tls=self.config.nats_tls)
                    admin = creds_path(run_dir, Role.ADMIN)
                if nats_url is None and self.config.nats_nodes > 1:
                    from t1async.transport.natscluster import start_embedded_cluster

                    def record(name: str, pid: int, log_path: str) -> None:
                        self.state.components[name] = proc_info(name, pid, log_path)
                        self.state.save()

                    nats_cluster = await start_embedded_cluster(
                        stack, run_dir, self.config.nats_nodes, self.config.max_payload, record, auth
                    )
                    nats_url = nats_cluster.url
                    self.state.monitor_url = nats_cluster.nodes[0].monitor_url
                elif nats_url is None:
                    from t1async.transport.natscluster import start_embedded_server

                    srv = await start_embedded_server(
                        stack, run_dir, self.config.nats_port, self.config.max_payload, auth
                    )
                    nats_url = srv.url
                    self.state.monitor_url = srv.monitor_url
                    self.state.components["nats"] = proc_info("nats", srv.pid or 0, str(srv.log_path))
                if self.config.stream_replicas or auth is not None:  # components may not create streams
                    from t1async.transport.natscluster import ensure_replicas

                    await ensure_replicas(nats_url, self.config.stream_replicas, admin)
                self.state.nats_url = nats_url
                self.state.save()
                async with anyio.create_task_group() as tg:
                    for spec in component_specs(self.config, nats_url):
                        await tg.start(self._run_process, spec, nats_url, tg.cancel_scope)
                    # the stop signals are caught before the run dir says "running": whoever reads that and
                    # hangs up or runs `down` at once must not hit the ignored-while-starting window
                    with receive(*STOP, signal.SIGHUP) as signals:
                        self.state.status = RunStatus.RUNNING
                        self.state.save()
                        log.info("cluster.up", nats_url=nats_url, run_dir=str(run_dir), pid=os.getpid())
                        print(
                            f"cluster up: nats {nats_url}, run dir {run_dir} (Ctrl-C or "
                            f"`python -m t1async.cluster down --run-dir {run_dir}` to stop)",
                            flush=True,
                        )
                        if self.config.progress is not None:
                            tg.start_soon(self.config.progress, nats_url, run_dir)
                        await self._wait_for_stop(signals)
                    # a second Ctrl-C or a hang-up while stopping would leave components behind: let it finish
                    saved.update(
                        {
                            k: v
                            for k, v in set_handlers(
                                {signal.SIGHUP: signal.SIG_IGN, signal.SIGINT: signal.SIG_IGN}
                            ).items()
                            if k not in saved
                        }
                    )
                    self.state.status = RunStatus.STOPPING
                    self.state.save()
                    tg.cancel_scope.cancel()
        finally:
            self.state.status = RunStatus.STOPPED
            self.state.components.clear()
            self.state.save()
            set_handlers(saved)
        log.info("cluster.down", run_dir=str(run_dir), failed=self.failed)
        why = self.failed or self.finished
        print(f"cluster stopped{': ' + why if why else ''}", flush=True)
        return 1 if self.failed else 0

    def _refuse_if_running(self, run_dir: Path) -> None:
        try:
            old = ClusterState.load(run_dir)
        except ConfigError:
            return
        if old.status != RunStatus.STOPPED and old.supervisor is not None and is_ours(old.supervisor):
            raise ConfigError(
                f"a cluster is already running in {run_dir} (supervisor pid {old.supervisor.pid}): "
                f"stop it with `python -m t1async.cluster down --run-dir {run_dir}` or use another --run-dir"
            )

    async def _wait_for_stop(self, signals: AsyncIterator[int]) -> None:
        duration = self.config.duration_s if self.config.duration_s is not None else math.inf
        with anyio.move_on_after(duration):
            sig = await next_signal(signals)
            log.info("cluster.signal", signal=sig.name)
            return
        log.info("cluster.duration_elapsed", duration_s=duration)

    async def _run_process(
        self,
        spec: ProcessSpec,
        nats_url: str,
        cluster: anyio.CancelScope,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        path = Path(self.config.run_dir) / "logs" / f"{spec.name}.log"
        env = {**os.environ, "T1_NATS_URL": nats_url, **spec.env}
        first = True
        while not await self._run_once(spec, path, env, cluster, task_status if first else None):
            first = False
            # back off 1, 2, 4 ... 30 s by the restarts in the window: a crash loop does not spin
            await anyio.sleep(min(2.0 ** (len(self._restarts[spec.name]) - 1), 30.0))

    def _may_restart(self, name: str) -> bool:
        """Whether ``name`` may be restarted once more: fewer than ``max_restarts`` in the window."""
        now = time.monotonic()
        recent = [t for t in self._restarts[name] if now - t < self.config.restart_window_s]
        if len(recent) >= self.config.max_restarts:
            self._restarts[name] = recent
            return False
        self._restarts[name] = [*recent, now]
        return True

    async def _run_once(
        self, spec: ProcessSpec, path: Path, env: dict, cluster: anyio.CancelScope, task_status: TaskStatus[None] | None
    ) -> bool:
        """Run the process once; False when it exited and ``spec.restart`` asks for another run."""
        with open(path, "ab") as out:
            proc = await open_process(list(spec.argv), stdout=out, stderr=out, env=env, start_new_session=True)
        self.state.components[spec.name] = proc_info(spec.name, proc.pid, str(path), list(spec.argv))
        self.state.save()
        log.info("cluster.started", name=spec.name, pid=proc.pid, log=str(path))
        try:
            if task_status is not None:
                if spec.ready_file is not None:
                    await self._wait_ready(spec, proc, path)
                task_status.started()
            await proc.wait()
            if spec.finishes and proc.returncode == 0:
                self.finished = f"{spec.name} finished"
                log.info("cluster.component_finished", name=spec.name)
            elif spec.restart and proc.returncode != EXIT_CONFIG and self._may_restart(spec.name):
                log.warning(
                    "cluster.component_restarting",
                    name=spec.name,
                    returncode=proc.returncode,
                    restarts=len(self._restarts[spec.name]),
                    log=str(path),
                )
                return False
            else:
                if proc.returncode == EXIT_CONFIG:  # a configuration error: running it again cannot help
                    loop = " (a configuration error: not restarted)" if spec.restart else ""
                elif spec.restart and self.config.max_restarts:
                    n, window = self.config.max_restarts, self.config.restart_window_s
                    loop = f" (restarted {n} times in {window:.0f} s already)"
                else:
                    loop = ""
                why = last_line(path) if proc.returncode == EXIT_CONFIG else ""
                self.failed = f"{spec.name} (pid {proc.pid}) exited with code {proc.returncode}{loop}; see {path}" + (
                    f": {why}" if why else ""
                )
                log.error("cluster.component_exited", name=spec.name, returncode=proc.returncode, log=str(path))
            cluster.cancel()
            return True
        finally:
            with anyio.CancelScope(shield=True):
                await self._terminate(proc)
                await proc.aclose()
            log.info("cluster.stopped", name=spec.name, returncode=proc.returncode)

    async def _terminate(self, proc: ChildProcess) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; call under a shielded scope."""
        if proc.returncode is None:
            proc.terminate()
            with anyio.move_on_after(self.config.stop_timeout_s):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def _wait_ready(self, spec: ProcessSpec, proc: ChildProcess, log_path: Path) -> None:
        assert spec.ready_file is not None
        with anyio.move_on_after(spec.ready_timeout_s) as scope:
            while not spec.ready_file.exists():
                if proc.returncode is not None:
                    raise ServerStartError(
                        f"{spec.name} exited with code {proc.returncode} before it was ready; see {log_path}"
                    )
                await anyio.sleep(0.1)
        if scope.cancelled_caught:
            raise ServerStartError(f"{spec.name} was not ready within {spec.ready_timeout_s:.0f} s; see {log_path}")
        log.info("cluster.ready", name=spec.name)

    async def _run_oneshot(self, job: ProcessSpec) -> None:
        """Run a job to completion before the cluster starts (its output goes to its log)."""
        path = Path(self.config.run_dir) / "logs" / f"{job.name}.log"
        print(f"{job.name}: {job.note or 'running'} (log {path})", flush=True)
        with open(path, "ab") as out:
            proc = await open_process(list(job.argv), stdout=out, stderr=out, env={**os.environ, **job.env})
        try:
            self.state.components[job.name] = proc_info(job.name, proc.pid, str(path), list(job.argv))
            self.state.save()
            if not job.progress:
                await proc.wait()
            else:
                from t1async.cluster.observe.progress import phase_bars, watch_log_steps

                with phase_bars(job.name, job.progress) as bars:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(watch_log_steps, path, bars)
                        await proc.wait()
                        tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._terminate(proc)
                await proc.aclose()
                self.state.components.pop(job.name, None)
                self.state.save()
        if proc.returncode != 0:
            raise ServerStartError(f"{job.name} failed with exit code {proc.returncode}; see {path}")
        print(f"{job.name}: done", flush=True)


def python_module(module: str, *args: str) -> list[str]:
    """argv to run ``python -m module args...`` with this interpreter (for ProcessSpec)."""
    return [sys.executable, "-m", module, *args]
