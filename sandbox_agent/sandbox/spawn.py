"""Start a sandbox's host process from one thread that lives as long as the Python process.

Why. bwrap's ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, and Linux sends that signal when the *thread*
that forked the child exits, not when its process does. Under trio, ``anyio.open_process`` forks from a
worker thread of trio's cache, and an idle worker exits after 10 s: every sandbox it had started was then
SIGKILLed ten seconds into any idle gap. So every sandbox is forked by the process's one spawner thread
(``t1async.procs.in_spawner``, shared with the cluster's children), which never returns: the death signal
then fires only when the process itself dies, which is exactly the guard we want (a SIGKILLed actor takes
its sandboxes down, since the kernel ends the thread with the process).

``spawn()`` returns a ``HostProcess``: the subset of ``anyio.abc.Process`` the sandboxes use, over raw
non-blocking pipes (``FdSendStream``/``FdReceiveStream``) and a pidfd for ``wait()``, so it works the
same under trio and asyncio, whichever thread the event loop runs in.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

import anyio
import anyio.lowlevel
from anyio.abc import ByteReceiveStream, ByteSendStream

from t1async.procs import ChildProcess, in_spawner

_CHUNK = 1 << 16


class _PipeEnd:
    """One end of a pipe, non-blocking: its fd (None once closed) and ``aclose``."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd: int | None = fd

    async def aclose(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            anyio.notify_closing(fd)
            os.close(fd)
        await anyio.lowlevel.checkpoint()


class FdReceiveStream(_PipeEnd, ByteReceiveStream):
    """The read end of a pipe, non-blocking, as an anyio byte stream."""

    async def receive(self, max_bytes: int = _CHUNK) -> bytes:
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self.fd is None:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self.fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self.fd)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
            return data


class FdSendStream(_PipeEnd, ByteSendStream):
    """The write end of a pipe, non-blocking, as an anyio byte stream."""

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(item)
        while view:
            if self.fd is None:
                raise anyio.ClosedResourceError
            try:
                n = os.write(self.fd, view)
            except BlockingIOError:
                await anyio.wait_writable(self.fd)
                continue
            except OSError as exc:  # EPIPE: the reader is gone
                raise anyio.BrokenResourceError from exc
            view = view[n:]


class HostProcess(ChildProcess):
    """A child started by ``spawn``: ``t1async.procs.ChildProcess`` (``returncode``, ``wait`` on a pidfd,
    signals) with its three pipes as anyio byte streams."""

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int, stdin: int, stdout: int, stderr: int) -> None:
        super().__init__(popen, pidfd)
        self.stdin = FdSendStream(stdin)
        self.stdout = FdReceiveStream(stdout)
        self.stderr = FdReceiveStream(stderr)

    async def aclose(self) -> None:
        """Close the pipes and wait for the process (the caller has made it exit, or will)."""
        with anyio.CancelScope(shield=True):
            for s in (self.stdin, self.stdout, self.stderr):
                await s.aclose()
            await super().aclose()


def _popen(
    argv: Sequence[str], pass_fds: Sequence[int], start_new_session: bool, env: dict[str, str] | None
) -> HostProcess:
    ours: list[int] = []
    theirs: list[int] = []
    try:
        for _ in range(3):
            r, w = os.pipe2(os.O_CLOEXEC)
            ours.append(r)
            theirs.append(w)
        ours[0], theirs[0] = theirs[0], ours[0]  # stdin: the child reads, we write
        popen = subprocess.Popen(
            list(argv),
            stdin=theirs[0],
            stdout=theirs[1],
            stderr=theirs[2],
            pass_fds=tuple(pass_fds),
            start_new_session=start_new_session,
            env=env,
        )
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    pidfd = os.pidfd_open(popen.pid)  # nobody else reaps it, so this is our child
    return HostProcess(popen, pidfd, *ours)


async def spawn(
    argv: Sequence[str],
    *,
    pass_fds: Sequence[int] = (),
    start_new_session: bool = True,
    env: dict[str, str] | None = None,
) -> HostProcess:
    """Start ``argv`` with piped stdin/stdout/stderr, forked by the dedicated spawner thread.

    Raises OSError if it cannot be executed. The call blocks only a worker thread while the spawner forks.
    """
    fut = in_spawner(lambda: _popen(argv, pass_fds, start_new_session, env))
    return await anyio.to_thread.run_sync(fut.result)
