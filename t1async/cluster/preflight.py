"""``cluster up`` checks every outside dependency before it starts anything, and says what to do.

Each check raises ``ConfigError`` with one line: what is wrong, for which flag, and the fix. They run in
order of cost: the NATS server of ``--nats`` (a TCP connect and its INFO line: is it NATS, with
JetStream?), every ``--sampler-url`` (``/health``), the actors' sandbox (bubblewrap and the tools it needs),
then the task directory (present, loadable, with runnable tasks in the actors' split).
"""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from t1async.protocol.errors import ConfigError

_NO_NATS_FIX = (
    "start nats-server with JetStream there (`nats-server -js`), or leave out --nats and `cluster up` starts its own"
)


def _nats_info(host: str, port: int, timeout_s: float) -> dict:
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        buf = b""
        while b"\r\n" not in buf and len(buf) < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                break
            buf += chunk
    line = buf.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        raise ValueError(f"it answered {line[:40]!r}, not a NATS INFO line")
    return json.loads(line[5:])


def check_nats(url: str, timeout_s: float = 3.0) -> None:
    """At least one server of the comma-separated ``url`` answers as NATS with JetStream enabled."""
    errors = []
    for server in [u.strip() for u in url.split(",") if u.strip()]:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            raise ConfigError(f"--nats {url}: {server!r} is not a NATS URL (write nats://HOST:PORT)")
        host, port = parts.hostname, parts.port or 4222
        try:
            info = _nats_info(host, port, timeout_s)
        except (OSError, ValueError) as exc:
            errors.append(
                f"{host}:{port} ({type(exc).__name__}: {exc})" if str(exc) else f"{host}:{port} ({type(exc).__name__})"
            )
            continue
        if not info.get("jetstream"):
            raise ConfigError(
                f"--nats {url}: the server at {host}:{port} runs without JetStream: restart it with "
                f"`nats-server -js`, or leave out --nats and `cluster up` starts its own"
            )
        return
    raise ConfigError(f"--nats {url}: no NATS server answers at {', '.join(errors)}: {_NO_NATS_FIX}")


def check_samplers(urls: list[str] | tuple[str, ...], timeout_s: float = 5.0) -> None:
    """Every sampler answers ``GET /health`` with 200."""
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--sampler-url {url}: not an http(s) URL (write http://HOST:PORT)")
        try:
            resp = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s, trust_env=False)
        except httpx.HTTPError as exc:
            raise ConfigError(
                f"--sampler-url {url}: no answer from {url}/health ({type(exc).__name__}): start the "
                f"SGLang server there, or leave out --sampler-url to use the embedded sampler"
            ) from None
        if resp.status_code != 200:
            raise ConfigError(
                f"--sampler-url {url}: {url}/health answered HTTP {resp.status_code}: wait until the "
                f"server has loaded its model, or check its log"
            )


VLLM_PATHS = {  # what t1async calls on a vLLM server, and the server setting that enables it
    "/inference/v1/generate": "--enable-scale-out",
    "/pause": "VLLM_SERVER_DEV_MODE=1",
    "/collective_rpc": "VLLM_SERVER_DEV_MODE=1",
    "/update_weight_version": "VLLM_SERVER_DEV_MODE=1",
}


def check_vllm(urls: list[str] | tuple[str, ...], vllm_python: str | None, timeout_s: float = 10.0) -> str:
    """``--engine vllm``: each ``--sampler-url`` serves the endpoints t1async calls (read from its
    ``/openapi.json``); without URLs, vLLM is installed (``--vllm-python``) and recent enough. Returns what was
    found, for the log."""
    from t1async.sampler.vllm_launch import installed_version, resolve_python

    if not urls:
        python = resolve_python(vllm_python)
        return f"vLLM {installed_version(python)} in {python}"
    for url in urls:
        try:
            paths = httpx.get(f"{url.rstrip('/')}/openapi.json", timeout=timeout_s, trust_env=False).json()["paths"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"--sampler-url {url}: no OpenAPI description at {url}/openapi.json ({type(exc).__name__}): is it a "
                "vLLM server? (--engine vllm)"
            ) from None
        missing = sorted({flag for path, flag in VLLM_PATHS.items() if path not in paths})
        if missing:
            raise ConfigError(
                f"--sampler-url {url}: this vLLM server lacks endpoints t1async needs: restart it with "
                f"{' and '.join(missing)} (and --worker-extension-cls t1async_vllm.T1WorkerExtension for MoE on CPU)"
            )
    return f"vLLM endpoints at {', '.join(urls)}"


def check_sandbox() -> None:
    """The actors can start a bubblewrap sandbox on this machine (bwrap, util-linux, root)."""
    from sandbox_agent.sandbox.base import SandboxConfig, SandboxStartError
    from sandbox_agent.sandbox.launch import check_host

    with tempfile.TemporaryDirectory(prefix="t1-preflight-") as d:
        try:
            check_host(SandboxConfig(), Path(d))
        except SandboxStartError as exc:
            raise ConfigError(f"the actors cannot run their sandbox here: {exc}") from None


def check_tasks(tasks_dir: Path, split: str = "train") -> int:
    """The task directory holds runnable tasks of ``split``; returns how many."""
    from actors.actor import load_task_pool

    try:
        return len(load_task_pool(Path(tasks_dir), split))
    except ConfigError as exc:
        raise ConfigError(f"--tasks {tasks_dir}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    """A loader's error as one line (a YAML error spans several: keep where and what)."""
    cause = exc.__cause__
    mark, problem = getattr(cause, "problem_mark", None), getattr(cause, "problem", None)
    text = str(exc)
    if mark is not None and problem:
        text = f"{text.split(':', 1)[0]}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(text.split())
