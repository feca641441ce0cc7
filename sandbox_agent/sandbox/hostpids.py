"""Host-side views of a rootful container's processes (psutil, and /proc for what it does not give): the host
pid of a pid inside a container, a shell's session, the conmon (and ``runc init``) of a t1 container, and
signalling them by pidfd (a recycled pid is never hit)."""

from __future__ import annotations

import os
import signal
import time

import psutil


def conmons(min_age_s: float, name: str | None = None) -> dict[int, str]:
    """pid -> container name of the conmon processes of t1 containers (``name``'s only, if given) that
    have run at least ``min_age_s``."""
    out: dict[int, str] = {}
    now = time.time()
    for p in psutil.process_iter(["cmdline", "create_time"]):
        argv, started = p.info["cmdline"] or [], p.info["create_time"] or now
        if not argv or os.path.basename(argv[0]) != "conmon" or "-n" not in argv[:-1]:
            continue
        cname = argv[argv.index("-n") + 1]
        if cname.startswith("t1-") and (name is None or cname == name) and now - started >= min_age_s:
            out[p.pid] = cname
    return out


def kill_tree(root: int) -> list[int]:
    """SIGKILL ``root`` and every descendant (conmon's ``runc init``); returns the pids signalled."""
    try:
        tree = [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
    except psutil.Error:
        tree = [root]
    for pid in tree:
        signal_pid(pid, signal.SIGSTOP)  # frozen first: nothing forks or re-parents while we kill
    for pid in tree:
        signal_pid(pid, signal.SIGKILL)
    return tree


def pidns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def host_pid(init: int, inner: int) -> int | None:
    """The host pid of the process that is ``inner`` in the pid namespace of host pid ``init``."""
    ns = pidns(init)
    for name in os.listdir("/proc"):
        if not name.isdigit() or pidns(int(name)) != ns:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("NSpid:") and line.split()[-1] == str(inner):
                        return int(name)
        except OSError:
            continue
    return None


def session(leader: int) -> set[int]:
    """Live host pids whose session is ``leader``'s (the shell ran ``setsid``, so: the shell and its jobs)."""
    out: set[int] = set()
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == leader and p.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                out.add(p.pid)
        except OSError:  # gone since
            continue
    return out


def signal_pid(pid: int, sig: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass
    finally:
        os.close(fd)
