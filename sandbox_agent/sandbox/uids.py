"""Uid slots and the host-side view of a sandbox's processes.

Every live sandbox runs its shell and all its children as its own uid, ``base_uid + slot``. That is what
makes RLIMIT_NPROC (counted per real uid in the initial user namespace) a per-sandbox limit, and it lets the
host find every process of a sandbox by uid (``sandbox_pids``), whatever it forked or daemonised.

``SlotPool`` hands out free slots. A slot is held by an ``flock`` on ``<slot_lock_dir>/uid-<uid>.lock`` for
the sandbox's lifetime, so slots are exclusive across every process on the machine (two pytest runs, two
actors), not only within one; the kernel drops the lock if the holder dies. A slot whose uid still owns
processes (left by a crashed holder) is skipped, never reused, and logged.

Signals go through pidfds, and only after the pidfd's process is checked to still be the sandbox's uid,
so a recycled pid is never hit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from sandbox_agent.sandbox.base import SandboxStartError

log = structlog.get_logger("sandbox_agent.sandbox")


def _proc_uid_state(pid: int) -> tuple[int, str] | None:
    """(real uid, state letter) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    uid, state = -1, "?"
    for line in status.splitlines():
        if line.startswith(b"State:"):
            state = line.split()[1].decode()
        elif line.startswith(b"Uid:"):
            uid = int(line.split()[1])
            break
    return uid, state


def uid_pids(uid: int, *, include_zombies: bool = False) -> set[int]:
    """Pids whose real uid is ``uid`` (zombies left out unless asked)."""
    out: set[int] = set()
    with os.scandir("/proc") as it:
        for entry in it:
            if not entry.name.isdigit():
                continue
            # No shortcut through the /proc/<pid> dir's owner: a non-dumpable process shows as root there.
            info = _proc_uid_state(int(entry.name))
            if info is None or info[0] != uid:
                continue
            if include_zombies or info[1] not in ("Z", "X"):
                out.add(int(entry.name))
    return out


def tree_pids(root: int) -> set[int] | None:
    """Live descendants of ``root`` (not root itself), from /proc/<pid>/task/<tid>/children; None if the
    kernel does not expose those files. Every process of a sandbox descends from its pid namespace's init
    (orphans are re-parented to it), so this finds them all at a fraction of the cost of ``uid_pids``."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    out: set[int] = set()
    todo = [root]
    while todo:
        for k in child_pids(todo.pop()):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (of all its threads); [] if it is gone."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(k) for k in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return kids


def signal_pids(uid: int, pids: set[int], sig: int) -> int:
    """Send ``sig`` to each pid still owned by ``uid``; returns how many were signalled."""
    sent = 0
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            continue
        try:
            info = _proc_uid_state(pid)  # checked after pidfd_open: the pidfd pins this exact process
            if info is None or info[0] != uid:
                continue
            signal.pidfd_send_signal(fd, sig)
            sent += 1
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return sent


@dataclass
class Slot:
    """A held uid slot. ``release()`` frees it (idempotent)."""

    index: int
    uid: int
    _fd: int | None = field(default=None, repr=False)
    _pool: SlotPool | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None
            if self._pool is not None:
                self._pool.forget(self.index)


class SlotPool:
    """Hands out uid slots ``base_uid + k``, ``0 <= k < max_slots``, exclusive machine-wide."""

    def __init__(self, base_uid: int, max_slots: int, lock_dir: str) -> None:
        self.base_uid, self.max_slots, self.lock_dir = base_uid, max_slots, Path(lock_dir)
        self._held: set[int] = set()

    def forget(self, k: int) -> None:
        """Slot ``k`` was released (its flock dropped): this process may hand it out again."""
        self._held.discard(k)

    def _try(self, k: int) -> Slot | None:
        if k in self._held:
            return None
        uid = self.base_uid + k
        path = self.lock_dir / f"uid-{uid}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        leftovers = uid_pids(uid)
        if leftovers:
            os.close(fd)
            log.warning("sandbox.slot_has_processes", uid=uid, pids=sorted(leftovers)[:10], count=len(leftovers))
            return None
        self._held.add(k)
        return Slot(index=k, uid=uid, _fd=fd, _pool=self)

    def acquire(self, slot: int | None = None) -> Slot:
        """A free slot (the lowest), or exactly ``slot``; SandboxStartError if none is free."""
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if slot is not None:
            if not 0 <= slot < self.max_slots:
                raise SandboxStartError(f"slot {slot} is out of range 0..{self.max_slots - 1}")
            got = self._try(slot)
            if got is None:
                raise SandboxStartError(
                    f"slot {slot} (uid {self.base_uid + slot}) is in use by another sandbox or still has "
                    f"processes; pass slot=None to get a free one"
                )
            return got
        for k in range(self.max_slots):
            got = self._try(k)
            if got is not None:
                return got
        raise SandboxStartError(
            f"all {self.max_slots} sandbox slots (uids {self.base_uid}..{self.base_uid + self.max_slots - 1}) "
            f"are busy: close some sandboxes or raise SandboxConfig.max_slots"
        )


_POOLS: dict[tuple[int, int, str], SlotPool] = {}


def slot_pool(base_uid: int, max_slots: int, lock_dir: str) -> SlotPool:
    """The process-wide pool for these settings (one per (base_uid, max_slots, lock_dir))."""
    key = (base_uid, max_slots, lock_dir)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = SlotPool(base_uid, max_slots, lock_dir)
    return pool
