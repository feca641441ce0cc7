"""Start the embedded sampler as a subprocess and stop it by PID: ``async with launch_sampler() as url``.

The child runs ``python -m t1async.sampler serve --config F.toml``, F its ``SamplerSettings`` (port 0 unless
given) with our ready file; we wait for that file (the URL, with the real port) and a 200 from ``/health``, and
on exit (also on error or cancellation) send SIGTERM to that PID, wait for the graceful shutdown, then SIGKILL if
it lingers. Its stdout/stderr go to ``log_path`` (a temporary file unless given); a failed start raises
``ServerStartError`` with the log's tail.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import httpx

from t1async.config import to_toml
from t1async.procs import ChildProcess, open_process, popen
from t1async.protocol.errors import ServerStartError
from t1async.sampler.settings import SamplerSettings

try:
    from t1async.log import get_logger
except ImportError:  # pragma: no cover
    import structlog

    def get_logger(name: str, **fields: Any) -> Any:
        return structlog.get_logger(name).bind(component=name, **fields)


log = get_logger("sampler.launch")


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def sampler_settings(model: str | os.PathLike | None, options: dict[str, Any]) -> SamplerSettings:
    """The child's settings: ``options`` are SamplerSettings fields; the port defaults to 0 (a free one)."""
    return SamplerSettings(**{"port": 0, **options, "model": None if model is None else Path(model)})


def command(settings: SamplerSettings, ready: Path) -> list[str]:
    """``sampler serve --config sampler.toml``, that file (written beside ``ready``) ``settings`` with
    ``ready`` as its ready file."""
    config = ready.with_name("sampler.toml")
    config.write_text(to_toml(replace(settings, ready_file=ready), header="launch_sampler's settings"))
    return [sys.executable, "-m", "t1async.sampler", "serve", "--config", str(config)]


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this very t1async
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "T1_LOG_JSON": "1", "PYTHONPATH": pythonpath, **(extra or {})}


@asynccontextmanager
async def launch_sampler(
    model: str | os.PathLike | None = None,
    *,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120.0,
    stop_timeout_s: float = 10.0,
    **options: Any,
) -> AsyncIterator[str]:
    """Run the embedded sampler for the duration of the block; yields its URL (``http://127.0.0.1:PORT``).

    ``options`` are SamplerSettings fields (port, host, dtype, seed, max_batch, prefix_cache_tokens,
    allowed_weight_roots, ...), handed to the child as its ``--config`` file. Keys go through ``env``
    (``T1_SAMPLER_API_KEY``, ``T1_SAMPLER_ADMIN_KEY``), never argv; the readiness probe is ``/health``, which
    needs none.
    """
    settings = sampler_settings(model, options)
    with tempfile.TemporaryDirectory(prefix="t1-sampler-") as tmp:
        ready = Path(tmp) / "url"
        logp = Path(log_path) if log_path else Path(tmp) / "sampler.log"
        with open(logp, "ab") as logf:
            proc = await open_process(command(settings, ready), stdout=logf, stderr=logf, env=_child_env(env))
        log.info("sampler.launching", pid=proc.pid, port=settings.port, log=str(logp))
        try:
            url = await _wait_ready(proc, ready, logp, start_timeout_s)
            log.info("sampler.launched", pid=proc.pid, url=url)
            yield url
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(proc, stop_timeout_s)


class SamplerProcess:
    """The same, synchronously (for session-scoped pytest fixtures and scripts): ``start()`` -> URL, ``stop()``."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 10.0,
        **options: Any,
    ) -> None:
        self.settings = sampler_settings(model, options)
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self._tmp = Path(tempfile.mkdtemp(prefix="t1-sampler-"))
        self.log_path = Path(log_path) if log_path else self._tmp / "sampler.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        ready = self._tmp / "url"
        with open(self.log_path, "ab") as logf:
            self.proc = popen(command(self.settings, ready), stdout=logf, stderr=logf, env=_child_env(self.env))
        deadline = time.monotonic() + self.start_timeout_s
        started = False
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"the sampler (pid {self.proc.pid}) exited with code {self.proc.returncode} before it was "
                        f"ready; log {self.log_path}:\n{_tail(self.log_path)}"
                    )
                if ready.is_file():
                    url = ready.read_text().strip()
                    try:
                        if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                            self.url, started = url, True
                            return url
                    except httpx.TransportError:
                        pass
                time.sleep(0.1)
            raise ServerStartError(
                f"the sampler (pid {self.proc.pid}) was not ready within "
                f"{self.start_timeout_s:.0f} s; log {self.log_path}:\n{_tail(self.log_path)}"
            )
        finally:
            if not started:
                self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("sampler.kill", pid=self.proc.pid, waited_s=self.stop_timeout_s)
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> SamplerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _wait_ready(proc: ChildProcess, ready: Path, logp: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    url = ""
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise ServerStartError(
                    f"the sampler (pid {proc.pid}) exited with code {proc.returncode} before it was ready; "
                    f"log {logp}:\n{_tail(logp)}"
                )
            if not url and ready.is_file():
                url = ready.read_text().strip()
            if url:
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            await anyio.sleep(0.1)
    raise ServerStartError(
        f"the sampler (pid {proc.pid}) was not ready within {timeout_s:.0f} s; log {logp}:\n{_tail(logp)}"
    )


async def _stop(proc: ChildProcess, timeout_s: float) -> None:
    """SIGTERM our child by its PID, wait for it, SIGKILL if it lingers."""
    if proc.returncode is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        with anyio.move_on_after(timeout_s):
            await proc.wait()
        if proc.returncode is None:
            log.warning("sampler.kill", pid=proc.pid, waited_s=timeout_s)
            proc.kill()
            await proc.wait()
    log.info("sampler.stopped", pid=proc.pid, returncode=proc.returncode)
