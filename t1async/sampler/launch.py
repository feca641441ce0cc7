"""Start the embedded sampler as a subprocess and stop it by PID: ``async with launch_sampler() as url``.

The child runs ``python -m t1async.sampler serve --port 0 --ready-file F``; we wait for F (the URL, with
the real port) and a 200 from ``/health``, and on exit (also on error or cancellation) send SIGTERM to
that PID, wait for the graceful shutdown, then SIGKILL if it lingers. Its stdout/stderr go to ``log_path``
(a temporary file unless given); a failed start raises ``ServerStartError`` with the log's tail.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from t1async.procs import ChildProcess, open_process, popen
from t1async.protocol.errors import ServerStartError

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


@dataclass(frozen=True)
class LaunchConfig:
    model_dir: str | None = None
    port: int = 0
    host: str = "127.0.0.1"
    dtype: str = "float32"
    seed: int = 0
    max_batch: int = 64
    prefix_cache_tokens: int | None = None
    allowed_weight_roots: tuple[str | os.PathLike, ...] = ()  # (): the model directory's parent
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 10.0

    def command(self, ready_file: Path) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "t1async.sampler",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
            "--max-batch",
            str(self.max_batch),
            "--ready-file",
            str(ready_file),
        ]
        if self.model_dir is not None:
            cmd += ["--model", str(self.model_dir)]
        if self.prefix_cache_tokens is not None:
            cmd += ["--prefix-cache-tokens", str(self.prefix_cache_tokens)]
        if self.allowed_weight_roots:
            cmd += ["--allowed-weight-roots", ",".join(str(r) for r in self.allowed_weight_roots)]
        return cmd


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this very t1async
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "T1_LOG_JSON": "1", "PYTHONPATH": pythonpath, **(extra or {})}


@asynccontextmanager
async def launch_sampler(
    model_dir: str | os.PathLike | None = None,
    *,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    **options: Any,
) -> AsyncIterator[str]:
    """Run the embedded sampler for the duration of the block; yields its URL (``http://127.0.0.1:PORT``).

    ``options`` are LaunchConfig fields: port, host, dtype, seed, max_batch, prefix_cache_tokens,
    allowed_weight_roots, start_timeout_s, stop_timeout_s. Keys go through ``env`` (``T1_SAMPLER_API_KEY``,
    ``T1_SAMPLER_ADMIN_KEY``), never argv; the readiness probe is ``/health``, which needs none.
    """
    cfg = LaunchConfig(model_dir=None if model_dir is None else str(model_dir), **options)
    with tempfile.TemporaryDirectory(prefix="t1-sampler-") as tmp:
        ready = Path(tmp) / "url"
        logp = Path(log_path) if log_path else Path(tmp) / "sampler.log"
        with open(logp, "ab") as logf:
            proc = await open_process(cfg.command(ready), stdout=logf, stderr=logf, env=_child_env(env))
        log.info("sampler.launching", pid=proc.pid, port=cfg.port, log=str(logp))
        try:
            url = await _wait_ready(proc, ready, logp, cfg.start_timeout_s)
            log.info("sampler.launched", pid=proc.pid, url=url)
            yield url
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(proc, cfg.stop_timeout_s)


class SamplerProcess:
    """The same, synchronously (for session-scoped pytest fixtures and scripts): ``start()`` -> URL, ``stop()``."""

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        log_path: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        **options: Any,
    ) -> None:
        self.cfg = LaunchConfig(model_dir=None if model_dir is None else str(model_dir), **options)
        self._tmp = Path(tempfile.mkdtemp(prefix="t1-sampler-"))
        self.log_path = Path(log_path) if log_path else self._tmp / "sampler.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        ready = self._tmp / "url"
        with open(self.log_path, "ab") as logf:
            self.proc = popen(self.cfg.command(ready), stdout=logf, stderr=logf, env=_child_env(self.env))
        deadline = time.monotonic() + self.cfg.start_timeout_s
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
                f"{self.cfg.start_timeout_s:.0f} s; log {self.log_path}:\n{_tail(self.log_path)}"
            )
        finally:
            if not started:
                self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.cfg.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("sampler.kill", pid=self.proc.pid, waited_s=self.cfg.stop_timeout_s)
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
