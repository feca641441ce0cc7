"""The run-dir state file ``<run-dir>/cluster.json``: which processes a running cluster started.

    {"run_dir": ..., "status": "starting|running|stopping|stopped", "nats_url": ..., "monitor_url": ...,
     "supervisor": {"name", "pid", "cmdline", "start_ticks"}, "components": {name: {same + "log"}},
     "updated_at": ...}

``down`` and ``status`` trust a PID only if ``/proc/<pid>`` still shows the recorded cmdline and start time,
so a reused PID is never signalled. Written atomically (temp file + rename). ``reap_stale`` stops what a
dead supervisor left behind (``up`` and ``down`` call it first).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from t1async.log import get_logger
from t1async.protocol.errors import ConfigError

log = get_logger("cluster")

STATE_FILE = "cluster.json"
DEFAULT_RUN_DIR = Path("runs/latest")


class RunStatus(StrEnum):
    """A cluster's ``status`` in ``cluster.json``, as the supervisor (and ``down``) move it along."""

    STARTING = "starting"  # the supervisor is starting NATS and the components
    RUNNING = "running"  # all started, and stop signals are handled
    STOPPING = "stopping"  # a stop was asked for or a component died: components are being stopped
    STOPPED = "stopped"  # nothing of the cluster runs (or ``down`` found it dead)


class ProcStatus(StrEnum):
    """What ``cluster status`` says of one recorded process."""

    ALIVE = "alive"  # its PID still shows the recorded cmdline and start time
    GONE = "gone"


@dataclass(frozen=True)
class ProcInfo:
    name: str
    pid: int
    cmdline: list[str]
    start_ticks: int  # field 22 of /proc/<pid>/stat: tells a reused PID apart
    log: str = ""


@dataclass
class ClusterState:
    run_dir: str
    status: RunStatus = RunStatus.STARTING
    nats_url: str = ""
    monitor_url: str = ""
    supervisor: ProcInfo | None = None
    components: dict[str, ProcInfo] = field(default_factory=dict)
    updated_at: float = 0.0

    def save(self) -> None:
        self.updated_at = time.time()
        path = state_path(self.run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True))
        os.replace(tmp, path)

    @classmethod
    def load(cls, run_dir: str | Path) -> ClusterState:
        path = state_path(run_dir)
        try:
            raw = json.loads(path.read_text())
            sup = raw.get("supervisor")
            return cls(
                run_dir=raw["run_dir"],
                status=RunStatus(raw["status"]),
                nats_url=raw.get("nats_url", ""),
                monitor_url=raw.get("monitor_url", ""),
                supervisor=ProcInfo(**sup) if sup else None,
                components={k: ProcInfo(**v) for k, v in raw.get("components", {}).items()},
                updated_at=float(raw.get("updated_at", 0.0)),
            )
        except FileNotFoundError:
            raise ConfigError(
                f"no cluster state at {path}: start one with `python -m t1async.cluster up --run-dir {run_dir}`"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cluster state {path} is unreadable ({type(exc).__name__}: {exc}); delete it") from exc


def state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STATE_FILE


def _read_proc(pid: int) -> tuple[list[str], int] | None:
    # not psutil: its start time is the epoch's (boot time + ticks), and the boot time /proc reports may move by
    # a second between two readers; a PID's identity across processes needs the raw ticks since boot
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)": state is field 3, starttime 22
    return [c.decode(errors="replace") for c in cmdline if c], ticks


def proc_info(name: str, pid: int, log: str = "", argv: list[str] | None = None) -> ProcInfo:
    """Describe a live process we started: its start time from /proc, and the argv we gave it (what /proc
    shows right after spawning can still be the parent's, before the child's exec)."""
    got = _read_proc(pid)
    if got is None:
        raise ConfigError(f"process {name} (pid {pid}) is not running")
    return ProcInfo(name, pid, list(argv) if argv is not None else got[0], got[1], log)


def is_ours(info: ProcInfo) -> bool:
    """True if ``info.pid`` is alive and is still the process we recorded (same cmdline and start time;
    a zombie, whose cmdline reads back empty, is not alive)."""
    got = _read_proc(info.pid)
    return got is not None and got[0] == info.cmdline and got[1] == info.start_ticks


def _wait_gone(info: ProcInfo, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_ours(info):
            return True
        time.sleep(0.05)
    return not is_ours(info)


def stop_recorded(info: ProcInfo, timeout: float) -> str:
    """SIGTERM a recorded process by PID (only if ``is_ours``), SIGKILL after ``timeout``; says what it did."""
    if not is_ours(info):
        return f"{info.name}: not running"
    try:
        os.kill(info.pid, signal.SIGTERM)
        if _wait_gone(info, timeout):
            return f"{info.name}: stopped (pid {info.pid})"
        os.kill(info.pid, signal.SIGKILL)
        _wait_gone(info, 5)
        return f"{info.name}: killed (pid {info.pid}, did not stop within {timeout}s of SIGTERM)"
    except ProcessLookupError:
        return f"{info.name}: stopped (pid {info.pid})"


def reap_stale(run_dir: str | Path, timeout: float = 10.0) -> list[str]:
    """Stop what an earlier, dead supervisor of ``run_dir`` left running (it was SIGKILLed, or its machine
    hung): each recorded component whose PID still shows the recorded cmdline and start time, newest first.
    A recycled PID is never signalled. Marks the state stopped; returns one line per process reaped."""
    try:
        old = ClusterState.load(run_dir)
    except ConfigError:
        return []
    if old.status == RunStatus.STOPPED or (old.supervisor is not None and is_ours(old.supervisor)):
        return []
    lines = []
    for info in reversed(list(old.components.values())):
        if is_ours(info):
            lines.append(stop_recorded(info, timeout))
            log.warning("cluster.reaped", name=info.name, pid=info.pid, run_dir=str(run_dir), result=lines[-1])
    old.status, old.components = RunStatus.STOPPED, {}
    old.save()
    return lines
