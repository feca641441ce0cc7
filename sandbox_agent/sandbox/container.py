"""ContainerSandbox: the same persistent-shell protocol as bwrap (shell.py), in a podman container.

The episode's container (``start_container``, its limits, guard and clean-up) is sandbox/lifecycle.py.
Each session (the agent's, the verifier's) is one ``podman exec -i`` of ``setsid bash`` running the
driver, so variables, cwd and background jobs persist within it, and the container's filesystem persists
across sessions of the episode, as in Terminal-Bench.

A timed-out command: the shell gets SIGUSR1 (its abort trap) and every other process of its session is
SIGTERMed, then SIGKILLed (``kill_grace_s``), inside the container; a shell that does not recover is
killed and the next call starts a fresh one in the same cwd.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from sandbox_agent.sandbox.base import (
    SHELL_RESTARTED,
    SHELL_STOPPED,
    ExecResult,
    OutputBuffer,
    SandboxClosedError,
    SandboxConfig,
    SandboxStartError,
    exec_result,
    exec_timeout,
    shell_exited_note,
    timed_out_note,
)
from sandbox_agent.sandbox.hostpids import host_pid as _host_pid
from sandbox_agent.sandbox.hostpids import session as _session
from sandbox_agent.sandbox.hostpids import signal_pid as _signal
from sandbox_agent.sandbox.lifecycle import podman_call
from sandbox_agent.sandbox.shell import DRIVER, Done, ShellChannel, ShellEOF
from sandbox_agent.sandbox.spawn import HostProcess, spawn
from t1async.log import get_logger
from t1async.protocol.errors import SandboxError

__all__ = ["ContainerSandbox"]

log = get_logger("sandbox_agent.sandbox.container")


class ContainerSandbox:
    """A persistent bash in a running container. Open with ``async with ContainerSandbox.open(...)``."""

    def __init__(self, podman: str, env: dict[str, str], container: str, workdir: str, config: SandboxConfig) -> None:
        self.podman, self._env, self.container, self.workdir, self.config = podman, env, container, workdir, config
        self._proc: HostProcess | None = None
        self._channel: ShellChannel | None = None
        self._shell_pid: int | None = None  # inside the container
        self._cwd_quoted: str | None = None
        self._lock = anyio.Lock()
        self._closed = False
        self._has_prlimit: bool | None = None
        self._host_shell: int | None = None  # the shell's host pid, found when first needed

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        podman: str,
        env: dict[str, str],
        container: str,
        workdir: str,
        config: SandboxConfig = SandboxConfig(),
        copies: tuple[tuple[str, str], ...] = (),
    ) -> AsyncIterator[ContainerSandbox]:
        """A shell session in ``container`` (cwd ``workdir``), after copying host dirs in (``copies``)."""
        for host, inside in copies:
            rc, _, err = await podman_call([podman, "exec", container, "rm", "-rf", inside], env)
            rc, _, err = await podman_call([podman, "cp", host, f"{container}:{inside}"], env)
            if rc != 0:
                raise SandboxStartError(f"podman cp {host} -> {inside} failed: {err.decode(errors='replace')[-500:]}")
        sb = cls(podman, env, container, workdir, config)
        rc, _, _ = await podman_call([podman, "exec", container, "sh", "-c", "command -v prlimit"], env)
        sb._has_prlimit = True if rc == 0 else None
        try:
            await sb._start()
            yield sb
        finally:
            with anyio.CancelScope(shield=True):
                await sb.aclose()

    async def _start(self) -> None:
        cmd = [
            self.podman,
            "exec",
            "-i",
            "-w",
            self.workdir,
            "-e",
            "HOME=/root",
            "-e",
            "TERM=dumb",
            self.container,
            "setsid",
            "-w",
            *self._fsize(),
            "bash",
            "--noprofile",
            "--norc",
            "-c",
            DRIVER,
        ]
        try:
            proc = await spawn(cmd, env=self._env)
        except OSError as exc:
            raise SandboxStartError(f"could not run {self.podman!r}: {exc}") from exc
        self._proc, self._channel = proc, ShellChannel(proc.stdin, proc.stdout)
        setup = "echo $$" if self._cwd_quoted is None else f"builtin cd -- {self._cwd_quoted} 2>/dev/null; echo $$"
        nonce = secrets.token_hex(16)
        buf = OutputBuffer(4096)
        done = None
        with anyio.move_on_after(self.config.startup_timeout_s):
            try:
                await self._channel.send(setup, nonce)
                done = await self._channel.read_until_done(nonce, buf)
            except (ShellEOF, anyio.BrokenResourceError):
                done = None
        if done is None or not buf.text().strip().isdigit():
            err = b""
            with anyio.move_on_after(1.0):
                try:
                    err = await proc.stderr.receive(8192)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
            await self._kill_session()
            raise SandboxStartError(
                f"the shell in container {self.container} did not start: "
                f"{(err.decode(errors='replace') or buf.text()).strip()[-600:]}"
            )
        self._shell_pid = int(buf.text().strip())
        self._cwd_quoted = done.cwd_quoted

    def _fsize(self) -> list[str]:
        """RLIMIT_FSIZE on the shell (podman's --ulimit fails here), when the image has prlimit (ours do)."""
        if self._has_prlimit is None:
            return []
        return ["prlimit", f"--fsize={self.config.file_size_bytes}:{self.config.file_size_bytes}", "--"]

    async def _kill_session(self) -> None:
        proc, self._proc, self._channel = self._proc, None, None
        if self._shell_pid is not None:
            shell = await self._host_shell_pid()
            if shell is not None:
                for _ in range(3):  # frozen first, so a fork bomb cannot outrun the kill
                    for pid in _session(shell):
                        _signal(pid, signal.SIGSTOP)
                for pid in _session(shell):
                    _signal(pid, signal.SIGKILL)
            self._shell_pid = self._host_shell = None
        if proc is not None:
            with anyio.CancelScope(shield=True):
                await proc.stdin.aclose()
                with anyio.move_on_after(2.0):
                    await proc.wait()
                proc.kill()
                await proc.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._kill_session()

    async def exec(self, command: str, *, timeout: float | None = None) -> ExecResult:
        timeout = exec_timeout(command, timeout, self.config)
        async with self._lock:
            if self._closed:
                raise SandboxClosedError("exec() on a closed sandbox")
            notes: list[str] = []
            if self._channel is None:
                await self._start()
                notes.append(SHELL_RESTARTED)
            channel = self._channel
            assert channel is not None
            out = OutputBuffer(self.config.output_limit_bytes)
            nonce = secrets.token_hex(16)
            t0 = time.monotonic()
            done: Done | None = None
            try:
                with anyio.move_on_after(timeout):
                    await channel.send(command, nonce)
                    done = await channel.read_until_done(nonce, out)
                if done is None:
                    done = await self._abort(channel, nonce, out)
                    notes.append(timed_out_note(timeout))
                    if done is None:
                        channel.take_pending(out)
                        await self._kill_session()
                        notes.append(SHELL_STOPPED)
                    return exec_result(out, None, True, t0, notes)
            except (ShellEOF, anyio.BrokenResourceError):
                rc = None
                if self._proc is not None:  # stdout closed: podman exec passes on the shell's status
                    with anyio.move_on_after(5.0):
                        rc = await self._proc.wait()
                await self._kill_session()
                notes.append(shell_exited_note(rc))
                return exec_result(out, rc, False, t0, notes)
            self._cwd_quoted = done.cwd_quoted
            return exec_result(out, done.status, False, t0, notes)

    async def _abort(self, channel: ShellChannel, nonce: str, out: OutputBuffer) -> Done | None:
        """Stop a timed-out command from the host (a fork bomb at the pids limit leaves no room for a
        ``podman exec`` inside): SIGUSR1 to the shell, SIGTERM to the rest of its session, then after the
        grace the session frozen (SIGSTOP, so nothing forks while we look) and SIGKILLed, the shell spared."""
        shell = await self._host_shell_pid()
        if shell is None:
            return None
        _signal(shell, signal.SIGUSR1)
        for pid in _session(shell) - {shell}:
            _signal(pid, signal.SIGTERM)
        await anyio.sleep(self.config.kill_grace_s)
        for _ in range(3):
            for pid in _session(shell) - {shell}:
                _signal(pid, signal.SIGSTOP)
        for pid in _session(shell) - {shell}:
            _signal(pid, signal.SIGKILL)
        with anyio.move_on_after(5.0):
            try:
                return await channel.read_until_done(nonce, out)
            except (ShellEOF, anyio.BrokenResourceError):
                return None
        return None

    async def _host_shell_pid(self) -> int | None:
        """The shell's pid as the host sees it (rootful podman: the container's processes are ours)."""
        if self._host_shell is None and self._shell_pid is not None:
            rc, out, _ = await podman_call(
                [self.podman, "inspect", "--format", "{{.State.Pid}}", self.container], self._env
            )
            init = int(out.decode().strip() or 0) if rc == 0 else 0
            self._host_shell = _host_pid(init, self._shell_pid) if init > 0 else None
        return self._host_shell

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"

    async def read_file(self, path: str) -> bytes:
        if self._closed:
            raise SandboxClosedError("read_file() on a closed sandbox")
        argv = [self.podman, "exec", self.container, "cat", "--", self._path(path)]
        rc, out, err = await podman_call(argv, self._env)
        if rc != 0:
            raise SandboxError(
                f"read_file({path!r}) in container {self.container}: {err.decode(errors='replace')[-300:]}"
            )
        return out

    async def write_file(self, path: str, data: bytes) -> None:
        if self._closed:
            raise SandboxClosedError("write_file() on a closed sandbox")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write_file data must be bytes, got {type(data).__name__}")
        p = self._path(path)
        script = f"mkdir -p -- {shlex.quote(os.path.dirname(p) or '/')} && cat > {shlex.quote(p)}"
        rc, _, err = await podman_call(
            [self.podman, "exec", "-i", self.container, "sh", "-c", script], self._env, stdin=bytes(data)
        )
        if rc != 0:
            raise SandboxError(
                f"write_file({path!r}) in container {self.container}: {err.decode(errors='replace')[-300:]}"
            )

    async def __aenter__(self) -> ContainerSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
