"""Container images for the container backend: podman set-up, the base image, the image map, task images.

Image registries are unreachable here; Debian's and PyPI's package registries are not. So:

- ``build_base()`` makes ``localhost/t1async/base:bookworm-6`` once: ``mmdebstrap --variant=minbase`` of
  Debian bookworm (python3 3.11, pip, venv, pytest, tmux, asciinema, curl, git, procps...), ``podman
  import``, then ``uv`` and ``pytest==8.4.1`` from PyPI wheels (downloaded on the host) and ``python``/
  ``pip`` links, as ``python:3.11-slim`` has them. Cached: a second call returns at once.
- The image map sends a Dockerfile's ``FROM`` to a local image: ``ubuntu:*``, ``debian:*``,
  ``python:3*``, ``buildpack-deps:*`` and ``ghcr.io/laude-institute/t-bench/*`` go to the base image.
  Users add ``[images]`` entries (fnmatch pattern = local image) in ``$T1_IMAGE_MAP`` (a TOML file,
  default ``~/.config/t1async/images.toml``); theirs win.
- ``task_image(task)`` builds the task's Dockerfile with ``--pull=never`` and the mapped ``FROM``, tagged by
  a content hash of its build context, so an unchanged task is built once.

Podman runs with ``--runtime runc`` (crun fails here on hybrid cgroups) and a ``containers.conf`` with
``default_ulimits = []`` (otherwise "setrlimit RLIMIT_NOFILE: Operation not permitted"), both through
``CONTAINERS_CONF`` pointing at a file we write, so the host's configuration is left alone.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import tomllib
from pathlib import Path

from sandbox_agent.images.buildfail import BuildFailure, parse_build_failure, unreachable_host
from sandbox_agent.images.dockerfile import TBENCH_BASE, TBENCH_WORKDIR, build_context, dockerfile_of
from sandbox_agent.images.wheelhouse import WHEELHOUSE, WHEELHOUSE_PACKAGES, cache_dir
from sandbox_agent.images.wheels import download
from sandbox_agent.sandbox.base import SandboxStartError
from sandbox_agent.tasks.task import Task
from t1async.log import get_logger

log = get_logger("sandbox_agent.images.build")

# The tag names the recipe's version: a changed recipe is a new image (and so new task images, whose tags hash
# the base's name too), never a stale one found under the old name.
BASE_IMAGE = "localhost/t1async/base:bookworm-6"
ROOTFS_IMAGE = "localhost/t1async/rootfs:bookworm"
BASE_PACKAGES = (
    "python3,python3-pip,python3-venv,python3-pytest,tmux,asciinema,curl,ca-certificates,procps,git,less,file"
)
PYPI_PACKAGES = ("uv", "pytest==8.4.1")
# The image's wheelhouse (WHEELHOUSE, WHEELHOUSE_PACKAGES) is described in sandbox_agent.images.wheelhouse.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's; the host's is mounted over it (host_ca_volumes)
OFFLINE_ENV = (
    ("UV_OFFLINE", "1"),
    ("UV_FIND_LINKS", WHEELHOUSE),
    ("UV_PYTHON_DOWNLOADS", "never"),
    ("UV_NO_PROGRESS", "1"),
    ("PIP_NO_INDEX", "1"),
    ("PIP_FIND_LINKS", WHEELHOUSE),
    ("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
    ("APT_CONFIG", "/etc/t1async/apt-offline.conf"),
)
# Offline, `apt-get update` can fetch nothing but spends ~7 s failing to resolve its mirrors: with no
# sources it has nothing to fetch, and `apt-get install -y curl` of what is installed still succeeds.
_APT_OFFLINE = 'Dir::Etc::sourcelist "/etc/t1async/no-sources.list";\nDir::Etc::sourceparts "/nonexistent";\n'
# What uv's installer leaves behind (`source $HOME/.local/bin/env` is in most published test scripts).
_UV_ENV = 'case ":${PATH}:" in *:"$HOME/.local/bin":*) ;; *) export PATH="$HOME/.local/bin:$PATH" ;; esac\n'
DEFAULT_MAP = {
    "ubuntu": BASE_IMAGE,
    "ubuntu:*": BASE_IMAGE,
    "debian": BASE_IMAGE,
    "debian:*": BASE_IMAGE,
    "python:3*": BASE_IMAGE,
    "buildpack-deps:*": BASE_IMAGE,
    "docker.io/library/*": BASE_IMAGE,
    "ghcr.io/laude-institute/t-bench/*": BASE_IMAGE,
}
CONTAINERS_CONF = """[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
INSTALL_HINT = "install it with `apt-get install -y podman runc mmdebstrap`"


class ImageError(SandboxStartError):
    """An image could not be built or resolved; the message names the step and the fix."""


class ImageBuildError(ImageError):
    """A task's image did not build: the task cannot run here, whatever the policy does. Reports count it
    apart from a policy's failures (status ``image_build_failed``)."""

    def __init__(self, task_id: str, failure: BuildFailure) -> None:
        self.task_id, self.step, self.host, self.cause = task_id, failure.step, failure.host, failure.cause
        at = f" at step `{failure.step}`" if failure.step else ""
        super().__init__(f"task {task_id!r}: image build failed{at}: {failure.cause}")


def podman() -> str:
    exe = shutil.which(os.environ.get("T1_PODMAN", "podman"))
    if exe is None:
        raise SandboxStartError(f"the container backend needs podman, which is not installed: {INSTALL_HINT}")
    return exe


def podman_available() -> bool:
    return shutil.which(os.environ.get("T1_PODMAN", "podman")) is not None


def podman_env() -> dict[str, str]:
    conf = cache_dir() / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def run_podman(
    *args: str, timeout: float = 600, check: bool = True, input: bytes | None = None, quiet: bool = True
) -> subprocess.CompletedProcess[bytes]:
    out = subprocess.run([podman(), *args], env=podman_env(), capture_output=quiet, timeout=timeout, input=input)
    if check and out.returncode != 0:
        err = (out.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise ImageError(f"podman {' '.join(args[:3])}... failed (exit {out.returncode}): {err}")
    return out


def image_exists(ref: str) -> bool:
    return run_podman("image", "exists", ref, check=False).returncode == 0


def cgroup_version() -> int:
    return 2 if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else 1


# ------------------------------------------------------------------------------------- base image


_base_lock = threading.Lock()


def build_base(*, force: bool = False, mirror: str = "http://deb.debian.org/debian") -> str:
    """Build the base image once (skipped when it exists, unless ``force``); returns its name."""
    if not force and image_exists(BASE_IMAGE):
        return BASE_IMAGE
    with _base_lock:  # threads of one process build it once; the others find it built
        if not force and image_exists(BASE_IMAGE):
            return BASE_IMAGE
        return _build_base(force, mirror)


def _build_base(force: bool, mirror: str) -> str:
    cache = cache_dir()
    tar = cache / "base-rootfs.tar"
    if force or not tar.exists():
        if shutil.which("mmdebstrap") is None:
            raise ImageError(f"building the base image needs mmdebstrap: {INSTALL_HINT}")
        part = tar.with_suffix(".part.tar")
        log.info("images.mmdebstrap", out=str(tar), packages=BASE_PACKAGES)
        r = subprocess.run(
            ["mmdebstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(part), mirror],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise ImageError(f"mmdebstrap failed (exit {r.returncode}): {r.stderr[-1500:]}")
        part.rename(tar)
    if force or not image_exists(ROOTFS_IMAGE):
        run_podman("import", "--change", 'CMD ["/bin/bash"]', str(tar), ROOTFS_IMAGE)
    with tempfile.TemporaryDirectory(prefix="t1-base-") as tmp:
        wheels = Path(tmp) / "wheels"
        house = Path(tmp) / "wheelhouse"
        for dest, names in ((wheels, PYPI_PACKAGES), (house, WHEELHOUSE_PACKAGES)):
            r = download(dest, names)
            if r.returncode != 0:
                raise ImageError(f"pip download {' '.join(names)} failed: {r.stderr[-1500:]}")
        (Path(tmp) / "uv-env").write_text(_UV_ENV)
        (Path(tmp) / "apt-offline.conf").write_text(_APT_OFFLINE)
        # python:3.*-slim has no EXTERNALLY-MANAGED marker (so `pip install x` works there); Debian's has one.
        (Path(tmp) / "Containerfile").write_text(
            f"FROM {ROOTFS_IMAGE}\n"
            "COPY wheels /tmp/wheels\n"
            f"COPY wheelhouse {WHEELHOUSE}\n"
            "COPY uv-env /root/.local/bin/env\n"
            "COPY apt-offline.conf /etc/t1async/apt-offline.conf\n"
            "RUN touch /etc/t1async/no-sources.list\n"
            "RUN pip install --no-index --break-system-packages --root-user-action=ignore /tmp/wheels/*.whl"
            " && rm -rf /tmp/wheels /usr/lib/python3*/EXTERNALLY-MANAGED"
            " && ln -sf /usr/bin/python3 /usr/local/bin/python && ln -sf /usr/bin/pip3 /usr/local/bin/pip"
            " && ln -sf /usr/local/bin/uv /root/.local/bin/uv && ln -sf /usr/local/bin/uvx /root/.local/bin/uvx"
            " && mkdir -p /logs/verifier /app\n"
            "ENV LANG=C.UTF-8 UV_SYSTEM_CERTS=1\n"
            'CMD ["/bin/bash"]\n'
        )
        run_podman("build", "--pull=never", "--network=none", "-t", BASE_IMAGE, tmp, timeout=1200)
    log.info("images.base_built", image=BASE_IMAGE)
    return BASE_IMAGE


# -------------------------------------------------------------------------------------- image map


def image_map() -> dict[str, str]:
    """Pattern -> local image: the defaults, then the user's TOML ``[images]`` table (theirs win)."""
    out = dict(DEFAULT_MAP)
    path = Path(os.environ.get("T1_IMAGE_MAP", Path.home() / ".config" / "t1async" / "images.toml"))
    if path.is_file():
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ImageError(f"image map {path}: invalid TOML: {exc}") from exc
        table = doc.get("images", {})
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ImageError(f'image map {path}: expected an [images] table of "pattern" = "local image" strings')
        out.update(table)
    return out


def resolve(ref: str, mapping: dict[str, str] | None = None) -> str | None:
    """The local image for ``ref``: the last matching pattern's (user entries come last), else ``ref`` itself
    when it exists locally, else None."""
    mapping = image_map() if mapping is None else mapping
    hit = None
    for pat, local in mapping.items():
        if fnmatch.fnmatchcase(ref, pat):
            hit = local
    if hit is not None:
        return hit
    return ref if image_exists(ref) else None


# ------------------------------------------------------------------------------------- task images


def context_hash(context: Path, dockerfile: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(context.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(context)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(dockerfile.read_bytes())
    h.update(BASE_IMAGE.encode())  # a new base recipe rebuilds the task images on it
    return h.hexdigest()[:16]


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE | re.MULTILINE)


def task_image_tag(task: Task) -> str:
    """The image the task runs in (not built here): its Dockerfile's content-hash tag, or the mapped image."""
    df = dockerfile_of(task)
    if df is None:
        if task.docker_image is None:
            return BASE_IMAGE
        local = resolve(task.docker_image)
        if local is None:
            raise ImageError(
                f"task {task.id!r} names image {task.docker_image!r}, which is not local and not in the "
                f'image map: add it to $T1_IMAGE_MAP ([images] "{task.docker_image}" = "local/image")'
            )
        return local
    ctx = build_context(task)
    assert ctx is not None
    return f"localhost/t1async/task-{_safe(task.id)}:{context_hash(ctx, df)}"


def missing_image(task: Task) -> str | None:
    """Why the task's image cannot be had (a base or image neither local nor in the image map), or None."""
    try:
        tag = task_image_tag(task)
    except ImageError as exc:
        return str(exc)
    df = dockerfile_of(task)
    if df is None:
        return None if tag == BASE_IMAGE or image_exists(tag) else f"image {tag!r} does not exist locally"
    mapping = image_map()
    stages: set[str] = set()
    for m in _FROM.finditer(df.read_text(encoding="utf-8", errors="replace")):
        ref = m.group(3)
        if ref not in stages and resolve(ref, mapping) is None:
            return (
                f"base image {ref!r} ({df}) is not local and not in the image map: add it to $T1_IMAGE_MAP "
                f'([images] "{ref}" = "local/image")'
            )
        alias = re.search(r"\bAS\s+(\S+)", m.group(4), re.IGNORECASE)
        if alias:
            stages.add(alias.group(1))
    return None


_build_locks: dict[str, threading.Lock] = {}
_build_locks_guard = threading.Lock()


def task_image(task: Task) -> str:
    """The task's image, built once per content hash of its build context (``--pull=never``). Concurrent
    episodes of one task (actor threads) wait for the one build instead of each running their own."""
    tag = task_image_tag(task)
    with _build_locks_guard:
        lock = _build_locks.setdefault(tag, threading.Lock())
    with lock:
        return _task_image(task, tag)


def _task_image(task: Task, tag: str) -> str:
    df = dockerfile_of(task)
    if df is None:
        return _ensure(tag)
    if image_exists(tag):
        return tag
    ctx = build_context(task)
    assert ctx is not None
    mapping = image_map()
    stages: set[str] = set()

    def repl(m: re.Match[str]) -> str:
        ref = m.group(3)
        rest = m.group(4)
        alias = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
        local = ref if ref in stages else resolve(ref, mapping)
        if alias:
            stages.add(alias.group(1))
        if local is None:
            raise ImageBuildError(
                task.id,
                BuildFailure(
                    f"FROM {ref}",
                    None,
                    f"base image {ref!r} ({df}) is not local and not in the image map: add it to $T1_IMAGE_MAP "
                    "or run `python -m sandbox_agent images build-base`",
                ),
            )
        if ref not in stages:
            try:
                _ensure(local)
            except ImageBuildError:
                raise
            except ImageError as exc:  # the mapped image is missing, or the base image did not build
                raise ImageBuildError(
                    task.id, BuildFailure(f"FROM {ref}", unreachable_host(str(exc)), str(exc))
                ) from exc
        workdir = f"\nWORKDIR {TBENCH_WORKDIR}" if TBENCH_BASE.match(ref) else ""  # as t-bench's images set
        return f"{m.group(1)}{m.group(2)}{local}{rest}{workdir}"

    text = _FROM.sub(repl, df.read_text(encoding="utf-8"))
    with tempfile.NamedTemporaryFile("w", suffix=".Dockerfile", delete=False) as f:
        f.write(text)
    try:
        log.info("images.task_build", task=task.id, tag=tag)
        trust = [f"--volume={host}:{inside}" for host, inside in host_ca_volumes()]
        argv = ["build", "--pull=never", *trust, "-f", f.name, "-t", tag, str(ctx)]
        out = subprocess.run([podman(), *argv], env=podman_env(), capture_output=True, timeout=1800)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        failure = parse_build_failure(out.stdout.decode(errors="replace"), out.stderr.decode(errors="replace"))
        log.warning("images.task_build_failed", task=task.id, step=failure.step, host=failure.host, cause=failure.cause)
        raise ImageBuildError(task.id, failure)
    return tag


def host_ca_volumes() -> tuple[tuple[str, str], ...]:
    """The host's CA bundle, read-only over the image's: (host, inside) for ``podman build``'s RUN volumes and
    for a container with the network, so ``pip``, ``apt-get`` and ``curl`` trust what the host trusts (here
    PyPI is reached through a TLS-intercepting proxy whose CA only the host's bundle has). Debian's pip and
    venvs made from it read that bundle; uv does with ``UV_SYSTEM_CERTS`` (set in the base image). A RUN
    volume is not committed, so a task's image keeps the bundle its Dockerfile made."""
    bundle = Path(os.environ.get("T1_HOST_CA_BUNDLE", CA_BUNDLE))
    return ((str(bundle), f"{CA_BUNDLE}:ro"),) if bundle.is_file() else ()


def _ensure(local: str) -> str:
    if local == BASE_IMAGE:
        return build_base()
    if not image_exists(local):
        raise ImageError(f"mapped image {local!r} does not exist locally: build or import it (podman images)")
    return local


def _safe(s: str) -> str:
    return re.sub(r"[^a-z0-9_.-]", "-", s.lower())[:60] or "task"


def image_workdir(image: str) -> str:
    out = run_podman("image", "inspect", "--format", "{{.Config.WorkingDir}}", image)
    return out.stdout.decode().strip() or "/"


def image_build_error(exc: BaseException) -> ImageBuildError | None:
    """The ImageBuildError behind ``exc`` (itself, inside an exception group, or its cause), else None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ImageBuildError):
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None
