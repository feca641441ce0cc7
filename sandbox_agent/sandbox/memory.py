"""MemorySandbox: the in-memory Sandbox for fast tests of the layers above. It runs nothing.

``exec`` hands the command to a handler you give (``command -> ExecResult | str``; a str means exit 0) and
caps its output exactly as the real sandbox does; every command is recorded in ``commands``. Files live
in ``files``, a dict keyed by the absolute sandbox path (``/workspace/...``), with the same path rules and
errors as BwrapSandbox (no symlinks). The default handler answers every command with empty output, exit 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sandbox_agent.sandbox.base import (
    SANDBOX_WORKDIR,
    ExecResult,
    SandboxClosedError,
    SandboxConfig,
    SandboxPathError,
    cap_output,
    workdir_relative,
)

Handler = Callable[[str], "ExecResult | str"]


def _ok(command: str) -> ExecResult:
    return ExecResult(output="", exit_code=0, timed_out=False, truncated=False, duration_s=0.0)


class MemorySandbox:
    def __init__(
        self,
        handler: Handler = _ok,
        *,
        files: dict[str, bytes] | None = None,
        workdir: Path = Path(SANDBOX_WORKDIR),
        config: SandboxConfig = SandboxConfig(),
    ) -> None:
        self.handler, self.workdir, self.config = handler, Path(workdir), config
        self.files: dict[str, bytes] = {}
        for path, data in (files or {}).items():
            self.files[self._key(path)] = bytes(data)
        self.commands: list[str] = []
        self._closed = False

    @staticmethod
    def _key(path: str) -> str:
        return SANDBOX_WORKDIR + "/" + "/".join(workdir_relative(path))

    async def exec(self, command: str, *, timeout: float | None = None) -> ExecResult:
        if self._closed:
            raise SandboxClosedError("exec() on a closed sandbox")
        if "\0" in command:
            raise ValueError("command contains a NUL byte, which bash cannot run: remove it")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.commands.append(command)
        t0 = time.monotonic()
        res = self.handler(command)
        if isinstance(res, str):
            res = ExecResult(output=res, exit_code=0, timed_out=False, truncated=False, duration_s=0.0)
        text, cut = cap_output(res.output, self.config.output_limit_bytes)
        return ExecResult(
            output=text,
            exit_code=res.exit_code,
            timed_out=res.timed_out,
            truncated=res.truncated or cut,
            duration_s=res.duration_s or time.monotonic() - t0,
        )

    async def read_file(self, path: str) -> bytes:
        if self._closed:
            raise SandboxClosedError("read_file() on a closed sandbox")
        key = self._key(path)
        if key in self.files:
            return self.files[key]
        if any(k.startswith(key + "/") for k in self.files):
            raise SandboxPathError(f"path {path!r} is not a regular file")
        raise FileNotFoundError(f"no such file in the sandbox: {path!r}")

    async def write_file(self, path: str, data: bytes) -> None:
        if self._closed:
            raise SandboxClosedError("write_file() on a closed sandbox")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"write_file data must be bytes, got {type(data).__name__}")
        key = self._key(path)
        if any(k.startswith(key + "/") for k in self.files):
            raise IsADirectoryError(f"path {path!r} is a directory")
        self.files[key] = bytes(data)

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> MemorySandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
