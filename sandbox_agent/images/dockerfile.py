"""A task's Dockerfile, read for what the bwrap backend can reproduce exactly (design §12).

bwrap runs over the host's Debian /usr, so it honours only the instructions it can reproduce exactly:

- ``FROM`` a generic base (``ubuntu``, ``debian``, ``python:3.*``, the Terminal-Bench base images): the
  host's python3, bash and coreutils stand in for it (with a ``python`` -> ``python3`` link);
- ``WORKDIR``: the task's work dir is bound there (e.g. ``/app``) and the shell starts in it;
- ``COPY``/``ADD`` of local files (no URLs, no ``--from``): copied into the work dir, or, outside it,
  into a per-episode dir bound read-write at the destination;
- ``ENV``: set in the shell's environment;
- metadata that changes nothing inside (``LABEL``, ``CMD``, ``ENTRYPOINT``, ``EXPOSE``, ``MAINTAINER``,
  ``SHELL``, ``USER root``, ``ARG`` with a default).

Anything else (``RUN``, ``USER`` someone, ``VOLUME``, multi-stage builds...) needs a container backend:
``BwrapPlan.refusal`` names the first such line. Never a silently wrong environment.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_agent.tasks.task import Task, TaskFormatError

_GENERIC_BASES = re.compile(
    r"^(docker\.io/(library/)?)?(ubuntu|debian|python|buildpack-deps)(:[\w.\-]+)?$"
    r"|^ghcr\.io/laude-institute/t-bench/[\w.\-/]+(:[\w.\-]+)?$"
)
# Terminal-Bench's base images (docker/base-images/*) end with ``WORKDIR /app``: a task FROM one of them and
# with no WORKDIR of its own runs in /app (its run-tests.sh refuses to run from /).
TBENCH_BASE = re.compile(r"^ghcr\.io/laude-institute/t-bench/")
TBENCH_WORKDIR = "/app"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SYSTEM = ("/usr", "/etc", "/bin", "/lib", "/lib64", "/sbin", "/proc", "/dev", "/sys")
_METADATA = frozenset({"LABEL", "CMD", "ENTRYPOINT", "EXPOSE", "MAINTAINER", "SHELL", "STOPSIGNAL", "HEALTHCHECK"})


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]  # relative to the build context
    dest: str  # absolute, inside the sandbox (a trailing "/" kept: "into this dir")


@dataclass(frozen=True)
class BwrapPlan:
    """What bwrap must do to reproduce a Dockerfile, or why it cannot (``refusal``)."""

    base: str
    workdir: str = "/"
    env: tuple[tuple[str, str], ...] = ()
    copies: tuple[Copy, ...] = ()
    context: Path = field(default=Path("."))
    refusal: str | None = None


def dockerfile_of(task: Task) -> Path | None:
    """The task's Dockerfile (TB1: the task root; TB2: ``environment/``), or None."""
    if task.docker_image and task.docker_image.startswith("dockerfile:"):
        return Path(task.docker_image.removeprefix("dockerfile:"))
    return None


def build_context(task: Task) -> Path | None:
    df = dockerfile_of(task)
    return None if df is None else df.parent


def parse(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped. Heredocs are not supported."""
    out: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        kw, _, args = buf.strip().partition(" ")
        out.append(Instruction(kw.upper(), args.strip(), start))
        buf = ""
    if buf.strip():
        kw, _, args = buf.strip().partition(" ")
        out.append(Instruction(kw.upper(), args.strip(), start))
    return out


def _words(args: str) -> list[str]:
    if args.startswith("["):
        try:
            v = json.loads(args)
        except json.JSONDecodeError:
            v = None
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return v
    return shlex.split(args)


def _expand(s: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), s)


def plan(task: Task) -> BwrapPlan | None:
    """The bwrap plan of the task's Dockerfile; None when the task has none."""
    df = dockerfile_of(task)
    if df is None:
        return None
    try:
        text = df.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskFormatError(f"{df}: cannot read the Dockerfile: {exc}") from exc
    return plan_text(text, df.parent, name=str(df))


def plan_text(text: str, context: Path, *, name: str = "Dockerfile") -> BwrapPlan:
    base, workdir = "", "/"
    env: dict[str, str] = {}
    args: dict[str, str] = {"PATH": DEFAULT_PATH}  # what ${PATH} means before an ENV sets it
    copies: list[Copy] = []

    def result(refusal: str | None = None) -> BwrapPlan:
        return BwrapPlan(base, workdir, tuple(env.items()), tuple(copies), context, refusal=refusal)

    def refuse(ins: Instruction, why: str) -> BwrapPlan:
        return result(f"{name}:{ins.line}: {ins.keyword} {ins.args[:80]!s} ({why})")

    for ins in parse(text):
        kw, a = ins.keyword, ins.args
        if kw == "FROM":
            if base:
                return refuse(ins, "a multi-stage build needs a container backend")
            words = [w for w in a.split() if not w.startswith("--")]
            base = _expand(words[0], args) if words else ""
            if not _GENERIC_BASES.match(base):
                return refuse(ins, f"base image {base!r} is not one the host's /usr stands in for")
            if TBENCH_BASE.match(base):
                workdir = TBENCH_WORKDIR
        elif kw == "WORKDIR":
            w = _expand(_words(a)[0] if a else "", {**args, **env})
            workdir = posixpath.normpath(posixpath.join(workdir, w))
        elif kw == "ENV":
            words = _words(a)
            if words and "=" not in words[0]:
                v = a.partition(" ")[2].strip()
                if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                    v = v[1:-1]
                env[words[0]] = _expand(v, {**args, **env})
            else:
                for w in words:
                    k, eq, v = w.partition("=")
                    if not eq:
                        return refuse(ins, "unparsable ENV")
                    env[k] = _expand(v, {**args, **env})
        elif kw == "ARG":
            k, eq, v = a.partition("=")
            if not eq:
                return refuse(ins, "ARG without a default value")
            args[k.strip()] = v.strip().strip('"')
        elif kw in ("COPY", "ADD"):
            words = _words(a)
            flags = [w for w in words if w.startswith("--")]
            words = [w for w in words if not w.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                return refuse(ins, "COPY --from needs a container backend")
            if len(words) < 2 or any("://" in w for w in words):
                return refuse(ins, "only local files can be copied without a container backend")
            dest = _expand(words[-1], {**args, **env})
            full = posixpath.normpath(posixpath.join(workdir, dest)) + ("/" if dest.endswith("/") else "")
            srcs = tuple(_expand(s, {**args, **env}) for s in words[:-1])
            for s in srcs:
                p = posixpath.normpath(s)
                if p.startswith("..") or posixpath.isabs(p) or any(c in s for c in "*?["):
                    return refuse(ins, f"source {s!r} is not a plain path inside the build context")
                if not (context / p).exists():
                    return refuse(ins, f"source {s!r} does not exist in the build context {context}")
            into = copy_dir(Copy(srcs, full), context)
            if into in ("/", "/tmp") or into.startswith(tuple(d + "/" for d in _SYSTEM)) or into in _SYSTEM:
                return refuse(ins, f"copying into {into} needs a container backend")
            copies.append(Copy(srcs, full))
        elif kw == "USER":
            if a.strip() not in ("root", "0", "0:0", "root:root"):
                return refuse(ins, "another user needs a container backend")
        elif kw in _METADATA:
            continue
        else:
            return refuse(ins, "needs a container backend to run")
    if workdir in ("/", "/tmp") or workdir.startswith(tuple(d + "/" for d in _SYSTEM)) or workdir in _SYSTEM:
        if workdir != "/":
            return result(f"{name}: WORKDIR {workdir} needs a container backend")
    return result()


def copy_dir(c: Copy, context: Path) -> str:
    """The directory a COPY writes into (Docker: a dir source's contents go into dest; a trailing / or
    several sources make dest a dir; else dest is the file's new path)."""
    if c.dest.endswith("/") or len(c.sources) > 1 or (context / c.sources[0]).is_dir():
        return posixpath.normpath(c.dest)
    return posixpath.dirname(c.dest)


def mounts(p: BwrapPlan, workdir: Path) -> dict[str, Path]:
    """Sandbox dir -> host dir, for each dir COPY writes outside the work dir (``<workdir>.mnt/<k>``)."""
    out: dict[str, Path] = {}
    for c in p.copies:
        d = copy_dir(c, p.context)
        if not _under(d, p.workdir) and d not in out:
            out[d] = Path(f"{workdir}.mnt") / str(len(out))
    return out


def _under(path: str, root: str) -> bool:
    return root != "/" and (path == root or path.startswith(root + "/"))


def stage(p: BwrapPlan, workdir: Path) -> None:
    """Do the plan's COPYs into ``workdir`` (seen at its WORKDIR) and into the host dirs of ``mounts``."""
    extra = mounts(p, workdir)
    for host in extra.values():
        host.mkdir(parents=True, exist_ok=True)
    for c in p.copies:
        d = copy_dir(c, p.context)
        if _under(d, p.workdir):
            host_dir = workdir / posixpath.relpath(d, p.workdir)
        else:
            host_dir = extra[d]
        host_dir.mkdir(parents=True, exist_ok=True)
        for s in c.sources:
            src = p.context / posixpath.normpath(s)
            if src.is_dir():
                shutil.copytree(src, host_dir, symlinks=True, dirs_exist_ok=True)
            elif c.dest.endswith("/") or len(c.sources) > 1:
                shutil.copy2(src, host_dir / src.name)
            else:
                shutil.copy2(src, host_dir / posixpath.basename(c.dest))
