"""The Sandbox seam: records, config, errors, the output cap and path rules shared by every backend.

Error tree (all under ``t1async.protocol.errors.SandboxError``)::

    SandboxError               a sandbox could not start, or died under us
    ├── SandboxStartError      it could not start (no bwrap, bwrap refused, not root...); says how to fix it
    │   └── ImageError         (sandbox_agent.images.build) a container image could not be built or resolved
    ├── SandboxClosedError     used after ``aclose()``: the caller's fault
    └── SandboxPathError       read_file/write_file on a path outside the work dir, or not a regular file
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from t1async.protocol.errors import ConfigError, SandboxError

#: Where the task's work dir appears inside every sandbox (bound read-write). Relative paths given to
#: ``read_file``/``write_file`` are relative to it; the shell starts there.
SANDBOX_WORKDIR = "/workspace"


class SandboxStartError(SandboxError):
    """The sandbox could not start. The message names the cause and how to fix it."""


class SandboxClosedError(SandboxError):
    """The sandbox was used after ``aclose()``."""


class SandboxPathError(SandboxError):
    """A file path outside the work dir (or escaping it through a symlink), or not a regular file."""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one ``exec``.

    ``output`` is stdout and stderr interleaved as written, capped to ``output_limit_bytes`` (head and tail kept
    around a ``[... N bytes truncated ...]`` note), decoded as UTF-8 with replacement. When the command timed
    out, or the shell died or was restarted, a bracketed note line is appended that says so.
    """

    output: str
    exit_code: int | None  # None when the command timed out or was killed
    timed_out: bool
    truncated: bool
    duration_s: float


@dataclass(frozen=True)
class SandboxConfig:
    command_timeout_s: float = 30.0
    output_limit_bytes: int = 16_384
    address_space_bytes: int = 2 << 30  # RLIMIT_AS, per process
    file_size_bytes: int = 256 << 20  # RLIMIT_FSIZE
    open_files: int = 256  # RLIMIT_NOFILE
    processes: int = 128  # RLIMIT_NPROC: counted per uid, and each slot has its own uid
    cpu_seconds: int = 600  # RLIMIT_CPU, per process
    tmp_size_bytes: int = 256 << 20  # size of the private /tmp tmpfs (and, capped at 64 MiB, of /dev/shm)
    base_uid: int = 20000  # slot k runs as uid base_uid + k
    extra_ro_binds: tuple[tuple[str, str], ...] = ()  # (host path, sandbox path), read-only
    # A task's Dockerfile subset (sandbox_agent.images.dockerfile): where the work dir appears (its WORKDIR, e.g.
    # /app; the shell starts there), its ENV, and dirs its COPY put outside the work dir (read-write).
    workdir_mount: str = SANDBOX_WORKDIR
    env: tuple[tuple[str, str], ...] = ()
    extra_rw_binds: tuple[tuple[str, str], ...] = ()  # (host path, sandbox path), read-write
    python_link: bool = True  # a `python` -> python3 on PATH when the host has no `python`
    # Not part of the first contract; defaults are what you want.
    bwrap_path: str = "bwrap"  # a name looked up on PATH, or an absolute path
    kill_grace_s: float = 1.0  # SIGTERM -> SIGKILL grace for a timed-out command
    startup_timeout_s: float = 20.0
    max_slots: int = 1000
    slot_lock_dir: str = "/tmp/.t1async-sandbox-slots"

    def __post_init__(self) -> None:
        for name in ("command_timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.kill_grace_s < 0:
            raise ConfigError(f"SandboxConfig.kill_grace_s must be >= 0, got {self.kill_grace_s!r}")
        if self.output_limit_bytes < 64:
            raise ConfigError(f"SandboxConfig.output_limit_bytes must be >= 64, got {self.output_limit_bytes}")
        for name in (
            "address_space_bytes",
            "file_size_bytes",
            "open_files",
            "processes",
            "cpu_seconds",
            "tmp_size_bytes",
            "max_slots",
        ):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"SandboxConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.open_files < 70:
            raise ConfigError(
                f"SandboxConfig.open_files must be >= 70 (the shell keeps fds 62 and 63), got {self.open_files}"
            )
        if not 1000 <= self.base_uid <= 2**31 - 1 - self.max_slots:
            raise ConfigError(f"SandboxConfig.base_uid must be an unused uid >= 1000, got {self.base_uid}")
        for what in ("extra_ro_binds", "extra_rw_binds", "env"):
            for pair in getattr(self, what):
                if len(pair) != 2 or not all(isinstance(p, str) for p in pair):
                    raise ConfigError(f"SandboxConfig.{what} entries must be pairs of strings, got {pair!r}")
        for pair in self.extra_ro_binds:
            if not posixpath.isabs(pair[1]) or posixpath.normpath(pair[1]) in _RESERVED:
                raise ConfigError(
                    f"extra_ro_binds sandbox path {pair[1]!r} must be absolute and not one of {sorted(_RESERVED)}"
                )
        for pair in self.extra_rw_binds:
            if not posixpath.isabs(pair[1]) or _reserved(posixpath.normpath(pair[1])):
                raise ConfigError(
                    f"extra_rw_binds sandbox path {pair[1]!r} must be absolute and not one of "
                    f"{sorted(_RESERVED)} (nor below /usr, /proc, /dev, /etc)"
                )
        m = self.workdir_mount
        if m != SANDBOX_WORKDIR and (not posixpath.isabs(m) or posixpath.normpath(m) != m or _reserved(m)):
            raise ConfigError(
                f"SandboxConfig.workdir_mount {m!r} must be a normalised absolute path, not one of "
                f"{sorted(_RESERVED)} nor below /usr, /proc, /dev, /etc (a Dockerfile WORKDIR there "
                f"needs a container backend)"
            )


_RESERVED = frozenset(
    {"/", "/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc", "/proc", "/dev", "/tmp", SANDBOX_WORKDIR}
)


def _reserved(path: str) -> bool:
    return path in _RESERVED or path.startswith(("/usr/", "/proc/", "/dev/", "/etc/", "/bin/", "/lib/", "/sbin/"))


@runtime_checkable
class Sandbox(Protocol):
    """A persistent shell plus file access in an isolated work dir. ``async with`` it; ``aclose`` ends it.

    ``exec`` runs one (possibly multi-line) bash command in the same shell as the previous ones (cwd,
    variables, functions and background jobs carry over). ``read_file``/``write_file`` take a path inside
    the sandbox: relative paths are relative to ``SANDBOX_WORKDIR`` (not to the shell's cwd), absolute
    ones must lie under it. A missing file raises ``FileNotFoundError``.
    """

    @property
    def workdir(self) -> Path | str:
        """The task's work dir: a host Path (bwrap; SANDBOX_WORKDIR inside), or the path inside the container
        (str, the container backend)."""
        ...

    async def exec(self, command: str, *, timeout: float | None = None) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def aclose(self) -> None: ...


SHELL_RESTARTED = (
    "[note: the shell was restarted: cwd kept; variables, functions and background jobs from earlier commands are gone]"
)
# the notes an ``exec`` appends when a command timed out or its shell went away (both shell backends)
_FRESH_SHELL = "the next command starts a fresh shell in the same directory (variables and background jobs are lost)"
SHELL_STOPPED = f"[the shell did not recover and was stopped; {_FRESH_SHELL}]"


def timed_out_note(timeout: float) -> str:
    return f"[timed out after {timeout:g} s: the command's processes were killed]"


def shell_exited_note(rc: int | None) -> str:
    return f"[the shell exited (status {rc}); {_FRESH_SHELL}]"


def exec_timeout(command: str, timeout: float | None, config: SandboxConfig) -> float:
    """The timeout an ``exec`` runs under (the config's default when None), after checking both arguments:
    ValueError naming what to change for a NUL byte in the command or a timeout that is not positive."""
    if "\0" in command:
        raise ValueError("command contains a NUL byte, which bash cannot run: remove it")
    timeout = config.command_timeout_s if timeout is None else timeout
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    return timeout


def exec_result(out: OutputBuffer, rc: int | None, timed_out: bool, t0: float, notes: list[str]) -> ExecResult:
    """An exec's result: its captured output with the sandbox's notes (restart, timeout, exit) on their own lines."""
    text = out.text()
    if notes:
        text += ("" if not text or text.endswith("\n") else "\n") + "\n".join(notes) + "\n"
    return ExecResult(
        output=text, exit_code=rc, timed_out=timed_out, truncated=out.truncated, duration_s=time.monotonic() - t0
    )


def workdir_relative(path: str) -> tuple[str, ...]:
    """The components of ``path`` below SANDBOX_WORKDIR, lexically normalised; SandboxPathError outside it."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxPathError(f"bad sandbox path {path!r}: give a non-empty string without NUL bytes")
    full = posixpath.normpath(path if posixpath.isabs(path) else posixpath.join(SANDBOX_WORKDIR, path))
    if full.startswith("//"):
        full = full[1:]
    if full != SANDBOX_WORKDIR and not full.startswith(SANDBOX_WORKDIR + "/"):
        raise SandboxPathError(
            f"path {path!r} is outside {SANDBOX_WORKDIR}: read_file/write_file only reach the work dir "
            f"(use exec('cat ...') for other files)"
        )
    parts = tuple(p for p in full[len(SANDBOX_WORKDIR) :].split("/") if p)
    if not parts:
        raise SandboxPathError(f"path {path!r} is the work dir itself, not a file")
    return parts


class OutputBuffer:
    """Keeps the first and last ``limit/2`` bytes of a stream of any length, in bounded memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._head_cap = limit // 2
        self._tail_cap = limit - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data[-self._tail_cap :]
            if len(self._tail) > 2 * self._tail_cap:  # trim lazily: amortised O(1) per byte
                del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        tail = self._tail[-self._tail_cap :] if self._tail else b""
        if not self.truncated:
            return (bytes(self._head) + bytes(tail)).decode("utf-8", errors="replace")
        dropped = self.total - len(self._head) - len(tail)
        return (
            self._head.decode("utf-8", errors="replace")
            + f"\n[... {dropped} bytes truncated ...]\n"
            + bytes(tail).decode("utf-8", errors="replace")
        )


def cap_output(data: bytes | str, limit: int) -> tuple[str, bool]:
    """``data`` capped like an exec's output: (text, truncated)."""
    buf = OutputBuffer(limit)
    buf.feed(data.encode("utf-8", errors="replace") if isinstance(data, str) else data)
    return buf.text(), buf.truncated
