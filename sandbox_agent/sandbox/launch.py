"""The bwrap command line of a BwrapSandbox, and the host checks before it runs (see bwrap.py for the why).

bwrap's options go through ``--args FD`` (so ``ps`` inside shows a short command line); generated files
(/etc/passwd, /etc/group, /etc/hosts, /etc/hostname and the shell driver) go through memfds and
``--ro-bind-data``, so nothing is written on the host.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from sandbox_agent.sandbox.base import SandboxConfig, SandboxStartError
from sandbox_agent.sandbox.shell import DRIVER

_ETC_FROM_HOST = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "timezone",
    "python3",
    "python3.11",
    "python3.12",
    "python3.13",
    "mime.types",
    "protocols",
    "services",
    "nsswitch.conf",
    "bash.bashrc",
    "inputrc",
    "magic",
    "magic.mime",
)
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LINKS = "/.t1/bin"  # on the sandbox's own root (tmpfs), after /usr/bin on PATH


def memfd(name: str, data: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def build_argv(cfg: SandboxConfig, workdir: Path, uid: int, data_fds: dict[str, int]) -> tuple[list[str], list[str]]:
    """bwrap's options (passed through ``--args FD``) and the command: setpriv, prlimit and bash.

    ``data_fds`` maps files to create inside (absolute paths) to fds holding their contents.
    """
    a = [
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for d in ("bin", "lib", "lib64", "sbin", "lib32", "libx32"):
        p = Path("/") / d
        if p.is_symlink():
            a += ["--symlink", os.readlink(p), f"/{d}"]
        elif p.is_dir():
            a += ["--ro-bind", str(p), f"/{d}"]
    a += ["--perms", "0755", "--dir", "/etc"]
    for name in _ETC_FROM_HOST:
        if os.path.exists(f"/etc/{name}"):
            a += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for path, fd in data_fds.items():
        a += ["--perms", "0644", "--ro-bind-data", str(fd), path]
    a += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(min(cfg.tmp_size_bytes, 64 << 20)),
        "--tmpfs",
        "/dev/shm",
        "--perms",
        "1777",
        "--size",
        str(cfg.tmp_size_bytes),
        "--tmpfs",
        "/tmp",
        "--bind",
        str(workdir),
        cfg.workdir_mount,
    ]
    for host, inside in cfg.extra_rw_binds:
        a += ["--bind", host, inside]
    for host, inside in cfg.extra_ro_binds:
        a += ["--ro-bind", host, inside]
    path = dict(cfg.env).get("PATH", _PATH)  # a task's Dockerfile ENV PATH replaces the default
    if cfg.python_link and not os.path.exists("/usr/bin/python") and os.path.exists("/usr/bin/python3"):
        a += ["--dir", _LINKS, "--symlink", "/usr/bin/python3", f"{_LINKS}/python"]  # python:3 images have one
        path += ":" + _LINKS
    a += [
        "--remount-ro",
        "/",
        "--chdir",
        cfg.workdir_mount,
        "--clearenv",
        "--setenv",
        "PATH",
        path,
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "TERM",
        "dumb",
        "--setenv",
        "USER",
        "agent",
        "--setenv",
        "LOGNAME",
        "agent",
        "--cap-add",
        "CAP_SETUID,CAP_SETGID,CAP_SETPCAP",
    ]
    for k, v in cfg.env:  # a task's Dockerfile ENV
        if k != "PATH":
            a += ["--setenv", k, v]
    command = [
        "/usr/bin/setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
        "/usr/bin/prlimit",
        *(
            f"--{k}={v}:{v}"
            for k, v in (
                ("as", cfg.address_space_bytes),
                ("fsize", cfg.file_size_bytes),
                ("nofile", cfg.open_files),
                ("nproc", cfg.processes),
                ("cpu", cfg.cpu_seconds),
            )
        ),
        "--",
        "/bin/bash",
        "--noprofile",
        "--norc",
        DRIVER_PATH,
    ]
    return a, command


DRIVER_PATH = "/etc/t1-shell.sh"


def data_files(uid: int) -> dict[str, str]:
    etc = {
        "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nagent:x:{uid}:{uid}:sandbox agent:/tmp:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nagent:x:{uid}:\nnogroup:x:65534:\n",
        "hostname": "sandbox\n",
        "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    }
    return {f"/etc/{name}": text for name, text in etc.items()} | {DRIVER_PATH: DRIVER}


def check_host(cfg: SandboxConfig, workdir: Path) -> str:
    """Everything that must hold before bwrap can start; returns bwrap's path."""
    bwrap = shutil.which(cfg.bwrap_path)
    if bwrap is None:
        raise SandboxStartError(
            f"bubblewrap not found (looked for {cfg.bwrap_path!r}): install it with `apt-get install bubblewrap`"
            f" or set SandboxConfig.bwrap_path"
        )
    for tool in ("/usr/bin/setpriv", "/usr/bin/prlimit", "/bin/bash"):
        if not os.access(tool, os.X_OK):
            raise SandboxStartError(f"{tool} is missing: install util-linux and bash (`apt-get install util-linux`)")
    if os.geteuid() != 0:
        raise SandboxStartError(
            f"BwrapSandbox must run as root (euid is {os.geteuid()}): it runs each sandbox as its own "
            f"unprivileged uid so that RLIMIT_NPROC binds; run the actors as root (as in a container)"
        )
    if not workdir.is_dir():
        raise SandboxStartError(f"work dir {str(workdir)!r} does not exist or is not a directory: create it first")
    for host, inside in cfg.extra_ro_binds:
        try:
            st = os.stat(host)
        except FileNotFoundError:
            raise SandboxStartError(f"extra_ro_binds source {host!r} (for {inside!r}) does not exist") from None
        need = (stat.S_IROTH | stat.S_IXOTH) if stat.S_ISDIR(st.st_mode) else stat.S_IROTH
        if st.st_mode & need != need:
            raise SandboxStartError(
                f"extra_ro_binds source {host!r} (mode {stat.S_IMODE(st.st_mode):04o}) is not readable by the "
                f"sandbox's unprivileged uid: make it world-readable, e.g. os.chmod({host!r}, 0o755)"
            )
    return bwrap
