"""The episode's container: started, limited, guarded and removed (sandbox.container runs shells in it).

One container per episode (``start_container``): ``podman run -d --init --network=none`` with memory,
pids and CPU limits, kept alive by ``sleep infinity`` under podman's init (which reaps orphans), labelled
with the owner's pid, and removed with ``podman rm -f -t 0`` on every exit path (also when cancelled).

If the actor process is SIGKILLed, no ``aclose`` runs: a guard process per container sees its pipe from
the actor close and removes the container; ``reap_orphans()`` (called before every new container)
removes any whose owner pid is gone all the same (say the guard was killed too). A start that fails or
hangs (``runc init`` stuck under its conmon; podman then does not list the container) is cleaned by name
on the spot, and ``reap_orphans()`` kills the runtime processes of any t1 container podman does not
list, once they are a minute old.
"""

from __future__ import annotations

import os
import secrets
import shlex
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from sandbox_agent.sandbox.base import SandboxStartError
from sandbox_agent.sandbox.hostpids import conmons, kill_tree
from sandbox_agent.sandbox.spawn import HostProcess, spawn
from t1async.log import get_logger

log = get_logger("sandbox_agent.sandbox.container")

OWNER_LABEL = "t1async.owner"
# podman's --memory/--pids-limit/--cpus map onto cgroup v1 controllers or v2 files alike; recorded in logs
_CGROUP = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1"


@dataclass(frozen=True)
class ContainerLimits:
    memory_bytes: int = 2 << 30
    pids: int = 512
    cpus: float = 2.0
    # A total cap on what an episode writes where agents write (the work dir, /tmp), or None: each is then a
    # tmpfs of this size holding the image's files (tmpcopyup). Off by default: tmpfs pages count against
    # the memory limit too, and the container's overlay here (ext4) takes no `--storage-opt size=` quota.
    disk_bytes: int | None = None


async def podman_call(
    argv: list[str], env: dict[str, str], *, timeout: float = 120, stdin: bytes | None = None
) -> tuple[int, bytes, bytes]:
    """Run podman (``argv`` from the binary on) without blocking the event loop: (exit code, stdout, stderr)."""
    # conmon (which `podman run -d` leaves behind) writes an `oom` file into its cwd when the container is
    # OOM-killed: run podman from a scratch dir of ours, not from wherever the user is
    scratch = Path(tempfile.gettempdir()) / "t1async-podman"
    scratch.mkdir(exist_ok=True)
    with anyio.fail_after(timeout):
        r = await anyio.run_process(argv, env=env, check=False, input=stdin, cwd=scratch)
    return r.returncode, r.stdout, r.stderr


async def reap_orphans(podman: str, env: dict[str, str], *, min_age_s: float = 60.0) -> list[str]:
    """Remove our containers whose owner process is gone (it was SIGKILLed before it could), and kill the
    runtime processes (conmon and its ``runc init``) of any t1 container podman no longer lists: a start
    that hung and was abandoned leaves those behind. Only ones older than ``min_age_s`` count, so a
    container another process is starting right now is left alone."""
    strays = conmons(min_age_s)
    rc, out, _ = await podman_call([podman, "ps", "-a", "--format", "{{.ID}} {{.Names}} {{.Labels}}"], env)
    dead: list[str] = []
    known: set[str] = set()
    for line in out.decode().splitlines():
        cid, _, rest = line.partition(" ")
        name, _, labels = rest.partition(" ")
        known.update((cid, name))
        pid = next(
            (
                int(x.split(":", 1)[1])
                for x in labels.strip("map[]").split()
                if x.startswith(OWNER_LABEL + ":") and x.split(":", 1)[1].isdigit()
            ),
            None,
        )
        if pid is not None and not os.path.exists(f"/proc/{pid}"):
            dead.append(cid)
    if dead:
        await podman_call([podman, "rm", "-f", "-t", "0", *dead], env)
        log.warning("container.orphans_removed", containers=dead)
    if rc == 0:  # an unreadable list knows no container: kill nothing on it
        for pid, name in strays.items():
            if name not in known:
                killed = kill_tree(pid)
                log.warning("container.stray_runtime_killed", name=name, conmon=pid, pids=killed)
                dead.append(name)
    return dead


@asynccontextmanager
async def start_container(
    podman: str,
    env: dict[str, str],
    image: str,
    *,
    limits: ContainerLimits,
    volumes: tuple[tuple[str, str], ...] = (),
    network: str = "none",
    tmpfs: tuple[str, ...] = (),
) -> AsyncIterator[str]:
    """One container for an episode; removed (SIGKILL, no grace) on exit, whatever happened. ``network``
    stays "none" while an agent acts; only a verifier the user allowed the network gets "bridge"."""
    await reap_orphans(podman, env)
    name = f"t1-{secrets.token_hex(6)}"
    argv = [
        podman,
        "run",
        "-d",
        "--init",
        "--name",
        name,
        f"--network={network}",
        "--label",
        f"{OWNER_LABEL}={os.getpid()}",
        f"--memory={limits.memory_bytes}",
        f"--memory-swap={limits.memory_bytes}",
        f"--pids-limit={limits.pids}",
        f"--cpus={limits.cpus:g}",
    ]
    for host, inside in volumes:
        argv += ["-v", f"{host}:{inside}"]
    if limits.disk_bytes is not None:  # ``tmpfs``: the paths that get a capped tmpfs (see ContainerLimits)
        for path in tmpfs:
            argv += ["--mount", f"type=tmpfs,destination={path},tmpfs-size={limits.disk_bytes},tmpcopyup"]
    try:
        rc, out, err = await podman_call([*argv, image, "sleep", "infinity"], env)
    except BaseException:  # timed out (a hung runtime) or cancelled: leave neither container nor runtime behind
        with anyio.CancelScope(shield=True):
            await _abandon(podman, env, name)
        raise
    if rc != 0:
        with anyio.CancelScope(shield=True):
            await _abandon(podman, env, name)
        raise SandboxStartError(f"podman run {image} failed (exit {rc}): {err.decode(errors='replace').strip()[-800:]}")
    log.debug(
        "container.started",
        name=name,
        image=image,
        cgroup=_CGROUP,
        memory=limits.memory_bytes,
        pids=limits.pids,
        cpus=limits.cpus,
    )
    guard: HostProcess | None = None
    try:
        # A guard in its own session waits on a pipe only we hold: if this process dies (SIGKILL included),
        # the pipe closes and the guard removes the container. On a normal exit we stop it and remove it here.
        guard = await spawn(
            ["/bin/sh", "-c", f"read _; exec {shlex.quote(podman)} rm -f -t 0 {name}"], env=env, start_new_session=True
        )
        yield name
    finally:
        with anyio.CancelScope(shield=True):
            if guard is not None:
                guard.kill()
                await guard.aclose()
            await podman_call([podman, "rm", "-f", "-t", "0", name], env)


async def _abandon(podman: str, env: dict[str, str], name: str) -> None:
    """Clean up a start that failed or hung: the container if podman recorded it, its conmon and runc init
    if they were left running (``podman ps`` does not list such a container, so ``rm`` alone misses them)."""
    try:
        await podman_call([podman, "rm", "-f", "-t", "0", name], env, timeout=60)
    except (TimeoutError, OSError):
        pass
    for pid in conmons(0.0, name):
        log.warning("container.stray_runtime_killed", name=name, conmon=pid, pids=kill_tree(pid))
