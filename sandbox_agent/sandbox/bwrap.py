"""BwrapSandbox: a persistent bash inside bubblewrap, run as a dedicated uid with rlimits.

How it is put together (the host must be root; the reason is the uid, see below)::

    bwrap --args FD (root, privileged mode: no user namespace)   ← our child, own session
      --unshare-ipc/pid/net/uts/cgroup  --die-with-parent --new-session   (forked by spawn.py's one
                                                                         long-lived thread: see there)
      / = empty tmpfs, remounted read-only; /usr ro (+ /bin /lib /lib64 /sbin symlinks); a minimal /etc
      (generated passwd/group/hosts/hostname + ld.so.cache, alternatives, python3*...; no shadow);
      /proc; /dev (+ a small /dev/shm); /tmp tmpfs of tmp_size_bytes; the work dir rw at /workspace;
      extra_ro_binds ro; env cleared to PATH, HOME=/tmp, LANG=C.UTF-8, TERM=dumb
      └─ setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all --no-new-privs
         └─ prlimit --as --fsize --nofile --nproc --cpu (soft = hard)
            └─ bash --noprofile --norc /etc/t1-shell.sh  (the persistent shell: shell.py)

Why not an unprivileged user namespace: inside one the sandbox is "root" mapped from our uid, and bwrap
then cannot bind a work dir below a 0700 directory (pytest's tmp dirs). Here bwrap binds as real root,
and the shell runs as the real, unprivileged uid ``U = base_uid + slot`` in the initial user namespace:
no capabilities, no_new_privs (setuid binaries do nothing), and RLIMIT_NPROC, which the kernel counts per
real uid, binds for real: a fork bomb stops at ``processes``. Each live sandbox owns its uid (SlotPool),
so the host can find and kill every process of a sandbox by uid.

Timeouts. When a command runs past its timeout the shell gets SIGUSR1, which makes it abandon the rest of
that command (shell.py), and every process of the sandbox that was not there when the command started
is SIGTERMed, then SIGKILLed after ``kill_grace_s`` (what the command put in the background too). The
shell then prints its marker and lives on with all its state. If it does not within the grace period (an
endless loop in the shell itself, ``while :; do :; done``; a closed stdout; bash's own fork-retry sleeps
under a fork bomb), the sandbox is torn down
and a fresh shell is started in the same cwd on the next call: variables, functions and background jobs
are lost, and the result's output says so. A command that makes the shell exit (``exit 3``) returns
that status; the next call starts a fresh shell the same way. If the caller cancels an ``exec``, the
next ``exec`` first stops that command the same way a timeout would.

Teardown (``aclose``, context exit, also when cancelled): stdin is closed, bwrap is killed, which takes
the sandbox's pid namespace and everything in it, then the host waits until no process of the uid is
left (SIGKILLing stragglers) before it frees the slot.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import structlog

from sandbox_agent.sandbox import uids
from sandbox_agent.sandbox.base import (
    SANDBOX_WORKDIR,
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
from sandbox_agent.sandbox.files import chown_tree, read_beneath, write_beneath
from sandbox_agent.sandbox.launch import build_argv, check_host, data_files, memfd
from sandbox_agent.sandbox.shell import Done, ShellChannel, ShellEOF
from sandbox_agent.sandbox.spawn import HostProcess, spawn
from t1async.protocol.errors import SandboxError

log = structlog.get_logger("sandbox_agent.sandbox")


class _Session:
    """One running bwrap + shell."""

    def __init__(self, proc: HostProcess, channel: ShellChannel) -> None:
        self.proc, self.channel = proc, channel
        self.shell_pid: int | None = None  # host pid of the persistent bash (for its abort signal)
        self.init_pid: int | None = None  # host pid of the sandbox's pid-1 (bwrap's reaper)

    def pids(self, uid: int) -> set[int]:
        """The sandbox's live processes (all descendants of its init; by uid if that is unavailable)."""
        if self.init_pid is not None:
            found = uids.tree_pids(self.init_pid)
            if found is not None:
                return found
        return uids.uid_pids(uid)

    async def kill(self) -> None:
        with anyio.CancelScope(shield=True):  # bounded: bwrap dies at once on SIGKILL
            if self.proc.stdin is not None:
                await self.proc.stdin.aclose()
            if self.proc.returncode is None:
                with anyio.move_on_after(0.2):
                    await self.proc.wait()
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()
            await self.proc.aclose()


class BwrapSandbox:
    """The real sandbox. Open with ``async with BwrapSandbox.open(workdir, config, slot=None) as sb``."""

    def __init__(self, workdir: Path, config: SandboxConfig, slot: uids.Slot, bwrap: str) -> None:
        self.workdir, self.config, self.slot = workdir, config, slot
        self.uid = slot.uid
        self._bwrap = bwrap
        self._session: _Session | None = None
        self._cwd_quoted: str | None = None  # the shell's cwd, bash-quoted, after the last command
        self._inflight: tuple[str, set[int]] | None = None  # (nonce, pids before) of an unfinished exec
        self._lock = anyio.Lock()
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(
        cls, workdir: Path, config: SandboxConfig = SandboxConfig(), slot: int | None = None
    ) -> AsyncIterator[BwrapSandbox]:
        workdir = Path(workdir).resolve()
        bwrap = check_host(config, workdir)
        held = uids.slot_pool(config.base_uid, config.max_slots, config.slot_lock_dir).acquire(slot)
        sb = cls(workdir, config, held, bwrap)
        try:
            for d in (workdir, *(Path(host) for host, _ in config.extra_rw_binds)):
                await anyio.to_thread.run_sync(chown_tree, d, sb.uid, sb.uid)
            await sb._start()
            yield sb
        finally:
            with anyio.CancelScope(shield=True):
                await sb.aclose()

    # -- lifecycle -------------------------------------------------------------------------------------

    async def _start(self) -> None:
        data_fds = {path: memfd(path, text) for path, text in data_files(self.uid).items()}
        options, command = build_argv(self.config, self.workdir, self.uid, data_fds)
        args_fd = memfd("bwrap-args", "".join(a + "\0" for a in options))
        try:
            proc = await spawn(
                [self._bwrap, "--args", str(args_fd), "--", *command],
                pass_fds=(args_fd, *data_fds.values()),
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxStartError(f"could not run {self._bwrap!r}: {exc}") from exc
        finally:
            for fd in (args_fd, *data_fds.values()):
                os.close(fd)
        assert proc.stdin is not None and proc.stdout is not None
        session = _Session(proc, ShellChannel(proc.stdin, proc.stdout))
        self._session = session
        setup = ":" if self._cwd_quoted is None else f"builtin cd -- {self._cwd_quoted} 2>/dev/null"
        nonce = secrets.token_hex(16)
        buf = OutputBuffer(4096)
        with anyio.move_on_after(self.config.startup_timeout_s) as scope:
            try:
                await session.channel.send(setup, nonce)
                done = await session.channel.read_until_done(nonce, buf)
            except (ShellEOF, anyio.BrokenResourceError):
                done = None
        if scope.cancelled_caught or done is None:
            err = b""
            if proc.stderr is not None:
                with anyio.move_on_after(1.0):
                    err = await proc.stderr.receive(8192)
            self._session = None
            await session.kill()
            raise SandboxStartError(
                self._start_failure(
                    proc.returncode, err.decode(errors="replace"), buf.text(), timed_out=scope.cancelled_caught
                )
            )
        self._cwd_quoted = done.cwd_quoted
        alive = uids.uid_pids(self.uid)
        session.shell_pid = next(iter(alive)) if len(alive) == 1 else None  # only the shell runs yet
        inits = uids.child_pids(proc.pid)  # bwrap --unshare-pid: its one child is the namespace's pid 1
        if len(inits) == 1 and session.shell_pid in uids.child_pids(inits[0]):
            session.init_pid = inits[0]  # else not the layout we expect: find processes by uid instead
        log.debug("sandbox.started", uid=self.uid, slot=self.slot.index, pid=proc.pid, workdir=str(self.workdir))

    def _start_failure(self, rc: int | None, err: str, out: str, *, timed_out: bool) -> str:
        what = f"did not answer within {self.config.startup_timeout_s} s" if timed_out else f"exited with status {rc}"
        hint = "see bwrap's message; the arguments come from sandbox_agent.sandbox.launch.build_argv"
        if "No permissions" in err or "Operation not permitted" in err:
            hint = "bwrap needs root here (CAP_SYS_ADMIN) to create its namespaces; run as root"
        elif "Can't find source path" in err:
            hint = "a bind source is missing or unreadable: check the work dir and extra_ro_binds"
        msg = err.strip() or out.strip() or "(no message)"
        if len(msg) > 600:
            msg = msg[:200] + " ... " + msg[-300:]
        return f"bubblewrap sandbox failed to start: it {what}: {msg} ({hint})"

    async def aclose(self) -> None:
        """End the sandbox: every process of it is gone when this returns. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._session is not None:
                session, self._session = self._session, None
                await session.kill()
            try:
                await self._reap_uid(deadline_s=5.0)
            finally:
                self.slot.release()
            log.debug("sandbox.closed", uid=self.uid, slot=self.slot.index)

    async def _reap_uid(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while True:
            left = uids.uid_pids(self.uid, include_zombies=True)
            if not left:
                return
            if time.monotonic() > end:
                log.error("sandbox.processes_survived", uid=self.uid, pids=sorted(left)[:20])
                raise SandboxError(f"sandbox uid {self.uid}: processes {sorted(left)[:20]} survived teardown")
            uids.signal_pids(self.uid, left, 9)
            await anyio.sleep(0.02)

    # -- the Sandbox protocol ---------------------------------------------------------------------------

    async def exec(self, command: str, *, timeout: float | None = None) -> ExecResult:
        timeout = exec_timeout(command, timeout, self.config)
        async with self._lock:
            if self._closed:
                raise SandboxClosedError("exec() on a closed sandbox")
            notes: list[str] = []
            if self._inflight is not None:
                await self._abandon_inflight()
            if self._session is None:
                await self._start()
                notes.append(SHELL_RESTARTED)
            session = self._session
            assert session is not None
            out = OutputBuffer(self.config.output_limit_bytes)
            before = session.pids(self.uid)
            nonce = secrets.token_hex(16)
            t0 = time.monotonic()
            done: Done | None = None
            self._inflight = (nonce, before)  # cleared below; left set if the caller cancels us
            with anyio.move_on_after(timeout):
                try:
                    await session.channel.send(command, nonce)
                    done = await session.channel.read_until_done(nonce, out)
                except (ShellEOF, anyio.BrokenResourceError):
                    self._inflight = None
                    return await self._shell_died(session, out, t0, notes)
            timed_out = done is None
            if timed_out:
                done = await self._kill_command(session, before, nonce, out)
            self._inflight = None
            if timed_out:
                notes.append(timed_out_note(timeout))
                if done is None:
                    session.channel.take_pending(out)
                    self._session = None
                    await session.kill()
                    await self._reap_uid(deadline_s=5.0)
                    notes.append(SHELL_STOPPED)
            if done is not None:
                self._cwd_quoted = done.cwd_quoted
            return exec_result(out, None if timed_out or done is None else done.status, timed_out, t0, notes)

    async def _abandon_inflight(self) -> None:
        """An earlier exec was cancelled mid-command: stop that command (or the shell) before the next one."""
        assert self._inflight is not None
        (nonce, before), self._inflight = self._inflight, None
        session = self._session
        if session is None:
            return
        done = await self._kill_command(session, before, nonce, OutputBuffer(4096))
        if done is None:
            self._session = None
            await session.kill()
            await self._reap_uid(deadline_s=5.0)
        else:
            self._cwd_quoted = done.cwd_quoted
        log.info("sandbox.cancelled_command_stopped", uid=self.uid, shell_kept=done is not None)

    async def _kill_command(self, session: _Session, before: set[int], nonce: str, out: OutputBuffer) -> Done | None:
        """SIGTERM then SIGKILL what the command started; the shell's marker if it then recovers."""
        result: Done | None = None

        if session.shell_pid is not None:  # arm the shell's abort trap (shell.py) before killing
            uids.signal_pids(self.uid, {session.shell_pid}, signal.SIGUSR1)

        async def killer() -> None:
            grace_end = time.monotonic() + self.config.kill_grace_s
            sig = 15
            while True:
                victims = session.pids(self.uid) - before
                if victims:
                    uids.signal_pids(self.uid, victims, sig)
                if time.monotonic() >= grace_end:
                    sig = 9
                await anyio.sleep(0.05)

        with anyio.move_on_after(self.config.kill_grace_s + 1.0):
            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                try:
                    result = await session.channel.read_until_done(nonce, out)
                except (ShellEOF, anyio.BrokenResourceError):
                    result = None
                tg.cancel_scope.cancel()
        return result

    async def _shell_died(self, session: _Session, out: OutputBuffer, t0: float, notes: list[str]) -> ExecResult:
        self._session = None
        await session.kill()
        await self._reap_uid(deadline_s=5.0)
        rc = session.proc.returncode
        notes.append(shell_exited_note(rc))
        return exec_result(out, rc, False, t0, notes)

    def _as_workspace(self, path: str) -> str:
        """A path under the task's WORKDIR mount (e.g. /app/x) as the file API names it (/workspace/x)."""
        m = self.config.workdir_mount
        if m != SANDBOX_WORKDIR and (path == m or path.startswith(m + "/")):
            return SANDBOX_WORKDIR + path[len(m) :]
        return path

    async def read_file(self, path: str) -> bytes:
        if self._closed:
            raise SandboxClosedError("read_file() on a closed sandbox")
        return await anyio.to_thread.run_sync(read_beneath, self.workdir, self._as_workspace(path))

    async def write_file(self, path: str, data: bytes) -> None:
        if self._closed:
            raise SandboxClosedError("write_file() on a closed sandbox")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write_file data must be bytes, got {type(data).__name__}")
        await anyio.to_thread.run_sync(
            write_beneath, self.workdir, self._as_workspace(path), bytes(data), (self.uid, self.uid)
        )

    async def __aenter__(self) -> BwrapSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
