"""Host-side views of a rootful container's processes, read from /proc: the host pid of a pid inside a
container, a shell's session, the conmon (and ``runc init``) of a t1 container, and signalling them by
pidfd (a recycled pid is never hit)."""

from __future__ import annotations

import os
import signal


def conmons(min_age_s: float, name: str | None = None) -> dict[int, str]:
    """pid -> container name of the conmon processes of t1 containers (``name``'s only, if given) that
    have run at least ``min_age_s``."""
    out: dict[int, str] = {}
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                started = int(f.read().rsplit(")", 1)[1].split()[19]) / tick
        except (OSError, IndexError, ValueError):
            continue
        if not argv or os.path.basename(argv[0]) != b"conmon" or b"-n" not in argv[:-1]:
            continue
        cname = argv[argv.index(b"-n") + 1].decode(errors="replace")
        if cname.startswith("t1-") and (name is None or cname == name) and uptime - started >= min_age_s:
            out[int(entry)] = cname
    return out


def kill_tree(root: int) -> list[int]:
    """SIGKILL ``root`` and every descendant (conmon's ``runc init``); returns the pids signalled."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
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
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[3] == str(leader) and fields[0] not in ("Z", "X"):
            out.add(int(name))
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
