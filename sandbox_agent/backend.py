"""Where a task's sandboxes come from: the ``SandboxBackend`` seam.

``BwrapBackend`` runs tasks in the default environment (the host's /usr, read-only, under bubblewrap). A
task that names its own image (``Task.docker_image``) needs a container backend; ``require_backend``
raises ``TaskNeedsImage`` when the chosen backend cannot run it. A container backend (docker, podman,
a remote sandbox service) implements the same two members.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import AsyncContextManager, Callable, Protocol

import anyio

from sandbox_agent import dockerfile
from sandbox_agent.sandbox import BwrapSandbox, Sandbox, SandboxConfig
from sandbox_agent.sandbox.files import chown_tree
from sandbox_agent.tasks import Task, TaskNeedsImage


class SandboxBackend(Protocol):
    name: str

    def supports(self, task: Task) -> bool: ...

    def open(
        self,
        task: Task,
        workdir: Path,
        *,
        config: SandboxConfig | None = None,
        ro_binds: tuple[tuple[str, str], ...] = (),
    ) -> AsyncContextManager[Sandbox]:
        """A fresh sandbox session over ``workdir``, with extra read-only binds (host path, sandbox path)."""
        ...

    async def reclaim(self, sandbox: Sandbox, workdir: Path) -> None:
        """Give ``workdir`` back to ``sandbox`` after another session (the verifier's) used it."""
        ...


def require_backend(task: Task, backend: SandboxBackend) -> None:
    if not backend.supports(task):
        why = getattr(backend, "refusal", lambda t: None)(task)
        raise TaskNeedsImage(task, backend.name, why)


@dataclasses.dataclass
class BwrapBackend:
    """The default environment: bubblewrap over the host's /usr. Runs tasks without their own image."""

    config: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    name: str = "bwrap"

    def supports(self, task: Task) -> bool:
        return self.refusal(task) is None

    def refusal(self, task: Task) -> str | None:
        """Why this backend cannot run ``task`` exactly (None: it can)."""
        if task.docker_image is None:
            return None
        p = dockerfile.plan(task)
        if p is None:
            return f"it names image {task.docker_image!r}"
        return p.refusal

    def open(
        self,
        task: Task,
        workdir: Path,
        *,
        config: SandboxConfig | None = None,
        ro_binds: tuple[tuple[str, str], ...] = (),
    ) -> AsyncContextManager[Sandbox]:
        require_backend(task, self)
        cfg = config or self.config
        if ro_binds:
            cfg = dataclasses.replace(cfg, extra_ro_binds=tuple(cfg.extra_ro_binds) + tuple(ro_binds))
        p = dockerfile.plan(task)
        if p is not None:  # the Dockerfile subset: WORKDIR, ENV, COPY outside the work dir
            rw = tuple((str(host), inside) for inside, host in dockerfile.mounts(p, Path(workdir)).items())
            cfg = dataclasses.replace(
                cfg, workdir_mount=p.workdir if p.workdir != "/" else cfg.workdir_mount,
                env=tuple(cfg.env) + p.env, extra_rw_binds=tuple(cfg.extra_rw_binds) + rw)
        return BwrapSandbox.open(workdir, config=cfg)

    def prepare(self, task: Task, workdir: Path) -> None:
        """Stage the task's Dockerfile COPYs (into the work dir and its ``.mnt`` dirs) before the episode."""
        p = dockerfile.plan(task)
        if p is not None:
            dockerfile.stage(p, Path(workdir))

    async def reclaim(self, sandbox: Sandbox, workdir: Path) -> None:
        # every BwrapSandbox session chowns the work dir to its own uid; hand it back to the agent's
        uid = getattr(sandbox, "uid", None)
        if uid is not None:
            await anyio.to_thread.run_sync(chown_tree, Path(workdir), uid, uid)


@dataclasses.dataclass
class FactoryBackend:
    """A backend from a plain factory (tests: in-memory sandboxes). Supports every task."""

    factory: Callable[..., AsyncContextManager[Sandbox]]
    name: str = "factory"

    def supports(self, task: Task) -> bool:
        return True

    def open(
        self,
        task: Task,
        workdir: Path,
        *,
        config: SandboxConfig | None = None,
        ro_binds: tuple[tuple[str, str], ...] = (),
    ) -> AsyncContextManager[Sandbox]:
        return self.factory(task=task, workdir=workdir, config=config, ro_binds=ro_binds)

    async def reclaim(self, sandbox: Sandbox, workdir: Path) -> None:
        return None
