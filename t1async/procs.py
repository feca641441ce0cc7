"""Child processes that die with their parent (design §9).

Every process the cluster starts (nats-server, samplers, the learner and its ranks, actors, the evaluator)
goes through ``open_process`` (async) or ``popen`` (sync), which give it a parent-death signal
(``prctl(PR_SET_PDEATHSIG)``): when its parent dies, even by SIGKILL, the kernel signals it, so a killed
``cluster up`` leaves nothing behind, however deep the tree.

Two traps, and how they are avoided:

- The death signal fires when the parent *thread* that forked the child exits, not its process. Under trio,
  ``anyio.open_process`` forks from a worker thread of trio's cache, and an idle worker exits after 10 s.
  So every child here is forked by one dedicated thread that never returns (a daemon blocked on its queue):
  it ends only with the process.
- ``preexec_fn`` is unsafe in a threaded parent. Instead the child starts as a tiny shim,
  ``python -I -S -c SHIM PPID SIG FD argv...``, that calls prctl, exits if its parent already died
  (the race before prctl), then ``execvp``s the real argv; the spawn returns once that exec closed FD, so
  ``/proc/PID/cmdline`` already shows the real argv to whoever records it (``cluster.json``). The signal
  survives ``execve`` (it is cleared only for a set-uid binary): it guards a Go binary such as nats-server
  as well as Python.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import IO, Any, TypeVar

import anyio
import anyio.lowlevel
import psutil

PR_SET_PDEATHSIG = 1
T = TypeVar("T")

# argv: PPID SIG FD PROGRAM ARGS...; exit 1 when the parent died before the guard was set. FD is the write end of
# a pipe, closed by the exec (close-on-exec): the parent's read of EOF says the real program runs now.
_SHIM = (
    "import ctypes,os,sys\n"
    "libc=ctypes.CDLL(None,use_errno=True)\n"
    "if libc.prctl(1,int(sys.argv[2]),0,0,0)!=0:\n"
    " e=ctypes.get_errno();raise OSError(e,'prctl(PR_SET_PDEATHSIG): '+os.strerror(e))\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(1)\n"
    "os.set_inheritable(int(sys.argv[3]),False)\n"
    "os.execvp(sys.argv[4],sys.argv[4:])\n"
)


def guarded_argv(argv: Sequence[str], sig: int = signal.SIGKILL, fd: int = -1) -> list[str]:
    """``argv`` behind the shim: run by a child of this process, it gets ``sig`` when this process dies;
    ``fd`` (passed to the child) is closed when the real program starts.

    Raises FileNotFoundError/PermissionError here (as Popen would) when ``argv[0]`` cannot be executed."""
    if not argv:
        raise ValueError("empty argv")
    prog = str(argv[0])
    found = prog if os.sep in prog else shutil.which(prog)
    if found is None or not os.path.isfile(found):
        raise FileNotFoundError(2, f"no such program: {prog}", prog)
    if not os.access(found, os.X_OK):
        raise PermissionError(13, f"not executable: {found}", found)
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), str(int(sig)), str(fd), *map(str, argv)]


def _spawn(argv: Sequence[str], sig: int, kw: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Fork and exec ``argv`` behind the shim; returns once the real program is exec'd (or the shim died), so
    /proc/PID/cmdline shows ``argv`` to whoever records it. Runs in the spawner thread."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(guarded_argv(argv, sig, w), pass_fds=(w,), **kw)
    finally:
        os.close(w)
    try:
        while os.read(r, 64):
            pass
    finally:
        os.close(r)
    return proc


class _Spawner:
    """One thread that runs submitted callables, forever. Never joined: it must outlive every child."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="t1-spawner", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut


_spawner: _Spawner | None = None
_lock = threading.Lock()


def _forget_spawner() -> None:  # a forked child has no copy of the thread: it makes its own on demand
    global _spawner
    _spawner = None


os.register_at_fork(after_in_child=_forget_spawner)


def _get_spawner() -> _Spawner:
    global _spawner
    with _lock:
        if _spawner is None:
            _spawner = _Spawner()
        return _spawner


def in_spawner(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` (a fork) in the one spawner thread of this process, started on first use: a child forked
    there with a parent-death signal (this module's shim, bwrap's ``--die-with-parent``) gets it only when
    the process dies. The cluster's children and the sandboxes (``sandbox_agent/sandbox/spawn.py``) share it."""
    return _get_spawner().submit(fn)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (exited, not yet reaped by its parent).
    Another user's process counts; a PID recycled since is not told apart (the caller records more than a PID
    where that matters, as ``cluster.state`` does)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _popen_kwargs(
    env: Mapping[str, str] | None, cwd: str | os.PathLike | None, start_new_session: bool, **io: Any
) -> dict[str, Any]:
    return {"env": dict(env) if env is not None else None, "cwd": cwd, "start_new_session": start_new_session, **io}


def popen(
    argv: Sequence[str],
    *,
    pdeathsig: int = signal.SIGKILL,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    start_new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv)`` that gets ``pdeathsig`` when this process dies (forked by the spawner)."""
    guarded_argv(argv, pdeathsig)  # a missing program fails here, in the caller
    kw = _popen_kwargs(env, cwd, start_new_session, stdin=stdin, stdout=stdout, stderr=stderr)
    proc: subprocess.Popen[bytes] = in_spawner(lambda: _spawn(argv, pdeathsig, kw)).result()
    return proc


class ChildProcess:
    """A child started by ``open_process``: ``pid``, ``returncode``, ``wait``, signals, ``aclose`` (the part
    of ``anyio.abc.Process`` we use, without pipes). Waits on a pidfd, so it works under trio and asyncio."""

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int | None = None) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._pidfd = os.pidfd_open(popen.pid) if pidfd is None else pidfd  # nobody else reaps it: our child

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        while self.popen.poll() is None:
            await anyio.wait_readable(self._pidfd)  # a pidfd reads ready once the process has exited
        rc = self.popen.returncode
        assert rc is not None
        return rc

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def aclose(self) -> None:
        """Wait for the process (the caller has made it exit, or will) and release the pidfd."""
        with anyio.CancelScope(shield=True):
            await self.wait()
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1


async def open_process(
    argv: Sequence[str],
    *,
    pdeathsig: int = signal.SIGKILL,
    stdin: int | IO[Any] | None = subprocess.DEVNULL,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    start_new_session: bool = False,
) -> ChildProcess:
    """Start ``argv`` (no pipes: give files or DEVNULL), guarded by ``pdeathsig``; raises OSError when it
    cannot be executed. Blocks only a worker thread while the spawner forks."""
    guarded_argv(argv, pdeathsig)  # a missing program fails here, in the caller
    kw = _popen_kwargs(env, cwd, start_new_session, stdin=stdin, stdout=stdout, stderr=stderr)
    fut = in_spawner(lambda: ChildProcess(_spawn(argv, pdeathsig, kw)))
    child: ChildProcess = await anyio.to_thread.run_sync(fut.result)
    return child
