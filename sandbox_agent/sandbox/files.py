"""Host-side file access beneath a sandbox's work dir, safe against symlinks the sandbox planted.

The host reads and writes the work dir as root, so a naive ``open(workdir / path)`` would follow a symlink
such as ``/workspace/x -> /etc/shadow`` to a host file. Instead every component is opened with
``O_NOFOLLOW`` relative to the directory before it, and symlinks are resolved here, the way the sandbox
would see them: an absolute target is a path inside the sandbox and must lie under SANDBOX_WORKDIR, a
relative one may not climb above the work dir. Anything else raises SandboxPathError.
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path

from sandbox_agent.sandbox.base import SANDBOX_WORKDIR, SandboxPathError, workdir_relative

_MAX_SYMLINKS = 40
_DIR_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _walk_parent(root: Path, parts: tuple[str, ...], *, create: tuple[int, int] | None, shown: str) -> tuple[int, str]:
    """Open the parent directory of ``parts`` (resolving symlinks inside the work dir); returns (fd, name).

    With ``create=(uid, gid)`` missing directories are made, owned by that uid.
    """
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    stack = [root_fd]
    todo = list(parts)
    links = 0
    try:
        while True:
            name = todo.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) == 1:
                    raise SandboxPathError(f"path {shown!r} climbs above {SANDBOX_WORKDIR}")
                os.close(stack.pop())
                continue
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=stack[-1])
            except FileNotFoundError:
                if not todo:
                    return os.dup(stack[-1]), name
                if create is None:
                    raise
                os.mkdir(name, 0o755, dir_fd=stack[-1])
                os.chown(name, *create, dir_fd=stack[-1], follow_symlinks=False)
                fd = os.open(name, _DIR_FLAGS, dir_fd=stack[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                os.close(fd)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise SandboxPathError(f"path {shown!r}: too many levels of symbolic links")
                target = os.readlink(name, dir_fd=stack[-1])
                if posixpath.isabs(target):
                    try:
                        rel = workdir_relative(target)
                    except SandboxPathError:
                        raise SandboxPathError(
                            f"path {shown!r} leads through a symlink to {target!r}, outside {SANDBOX_WORKDIR}"
                        ) from None
                    while len(stack) > 1:
                        os.close(stack.pop())
                    todo = list(rel) + todo
                else:
                    todo = target.split("/") + todo
                continue
            if not todo:
                os.close(fd)
                return os.dup(stack[-1]), name
            if not stat.S_ISDIR(mode):
                os.close(fd)
                raise NotADirectoryError(f"{shown!r}: {name!r} is not a directory")
            stack.append(fd)
    finally:
        for fd in stack:
            os.close(fd)


def read_beneath(root: Path, path: str) -> bytes:
    parent, name = _walk_parent(root, workdir_relative(path), create=None, shown=path)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno == 40:  # ELOOP: the last component is a symlink (a race with the walk)
                raise SandboxPathError(f"path {path!r} changed into a symlink while being read") from exc
            if isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(f"no such file in the sandbox: {path!r}") from None
            raise
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SandboxPathError(f"path {path!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_beneath(root: Path, path: str, data: bytes, owner: tuple[int, int]) -> None:
    parent, name = _walk_parent(root, workdir_relative(path), create=owner, shown=path)
    try:
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=parent
            )
        except OSError as exc:
            if exc.errno == 40:
                raise SandboxPathError(f"path {path!r} changed into a symlink while being written") from exc
            raise
    finally:
        os.close(parent)
    with os.fdopen(fd, "wb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SandboxPathError(f"path {path!r} is not a regular file")
        f.truncate(0)
        f.write(data)
        if (st.st_uid, st.st_gid) != owner:
            os.fchown(f.fileno(), *owner)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give the work dir (and everything in it, symlinks themselves not followed) to the sandbox's uid."""
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
