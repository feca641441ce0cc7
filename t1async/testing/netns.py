"""Several "hosts" on one machine: Linux network namespaces joined by a bridge (needs root).

    with network(3) as net:                          # hosts 198.18.0.1..3/24 (the benchmarking range)
        a, b, c = net.hosts
        p = net.run_in(a, ["python", "-m", "..."], output=path)   # `ip netns exec`, tracked and stopped by PID
        net.listeners(a)                             # what listens in host a (`ss -ltnp` there)
        net.connections(a), net.pids(a)              # its TCP connections (`ss -tnp`), the PIDs inside it
        net.call_in(a, fn)                           # fn() in a thread that joined host a's network
        net.link_down(c, 20)                         # host c's cable out for 20 s, then back

Every host is a network namespace with loopback up and one veth whose other end is a port of a bridge that
lives in a namespace of its own: the root namespace gets no interface, address or route, and nothing made
here can send traffic outside the namespaces it made. Names are ``t1mh-<pid>-<n>-{br,h0,h1,...}`` (the PID of
the process that made them), so runs never collide. Leaving the block, normally, on error or on Ctrl-C,
stops every process started with ``run_in`` (SIGTERM, then SIGKILL, by PID), SIGKILLs by PID any process still
inside one of its namespaces (a child that outlived its parent), and deletes every namespace
(which deletes their veths and the bridge). ``reap()`` deletes what a killed run left: namespaces with the
prefix whose PID is no longer alive; ``network()`` runs it first.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from t1async.log import get_logger
from t1async.procs import pid_alive

log = get_logger("testing.netns")

PREFIX = "t1mh"
SUBNET = "198.18.0"  # RFC 2544's benchmarking range, 198.18.0.0/15: never routed anywhere
CLONE_NEWNET = 0x40000000
_counter = itertools.count()
T = TypeVar("T")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the test as root, as CI does)"
    for tool in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"):
        if os.access(tool, os.X_OK):
            return None
    return "the `ip` command (iproute2) is not installed"


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; a failure raises with ip's own message."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res.stdout


def namespaces() -> list[str]:
    """The names ``ip netns list`` shows."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def reap(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces a dead run left (``<prefix>-<pid>-...`` with that PID gone), after SIGKILLing the
    processes still inside them (by PID: only that run started processes there); returns their names."""
    gone = []
    for name in namespaces():
        m = re.match(rf"^{re.escape(prefix)}-(\d+)-", name)
        if m and not pid_alive(int(m.group(1))):
            for pid in ip("netns", "pids", name, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "del", name, check=False)
            gone.append(name)
    if gone:
        log.warning("netns.reaped", namespaces=gone)
    return gone


@dataclass(frozen=True)
class Host:
    name: str  # its network namespace
    addr: str  # its address on the bridge
    port: str  # its cable: the bridge-side veth, in the bridge's namespace


@dataclass(frozen=True)
class Listener:
    addr: str
    port: int
    pids: tuple[int, ...]
    programs: tuple[str, ...]


@dataclass(frozen=True)
class Connection:
    local: tuple[str, int]  # (address, port)
    peer: tuple[str, int]
    pids: tuple[int, ...]


@dataclass
class Network:
    """The namespaces of one run, and the processes started in them (see the module docstring)."""

    bridge: str  # the bridge's namespace
    hosts: list[Host]
    procs: list[subprocess.Popen] = field(default_factory=list)
    _logs: list[object] = field(default_factory=list)

    def run_in(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        output: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``ip netns exec``, which execs: the PID is the command's), in its own
        session, stdout and stderr to ``output``; stopped by PID when the network closes (or by ``stop``)."""
        out = open(output, "ab") if output is not None else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        if output is not None:
            self._logs.append(out)
        p = subprocess.Popen(
            ["ip", "netns", "exec", host.name, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.procs.append(p)
        log.info("netns.started", host=host.name, pid=p.pid, argv=" ".join(argv[:4]))
        return p

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """``sig`` to ``p`` by PID, then SIGKILL after ``timeout_s``; its exit code."""
        if p.poll() is None:
            try:
                os.kill(p.pid, sig)
                p.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                log.warning("netns.kill", pid=p.pid, reason=f"still running {timeout_s:.0f}s after signal {sig}")
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        return p.wait()

    def set_link(self, host: Host, up: bool) -> None:
        """Plug (``up``) or unplug ``host``'s cable: its port on the bridge."""
        ip("-n", self.bridge, "link", "set", host.port, "up" if up else "down")
        log.info("netns.link", host=host.name, up=up)

    def link_down(self, host: Host, seconds: float) -> None:
        """Cut ``host``'s link for ``seconds`` (blocking), then restore it, also on error."""
        self.set_link(host, False)
        try:
            time.sleep(seconds)
        finally:
            self.set_link(host, True)

    def pids(self, host: Host) -> set[int]:
        """The PIDs of the processes inside ``host`` (``ip netns pids``)."""
        return {int(x) for x in ip("netns", "pids", host.name, check=False).split()}

    def connections(self, host: Host) -> list[Connection]:
        """The connected TCP sockets in ``host`` (``ss -Htnp`` there)."""

        def split(col: str) -> tuple[str, int]:
            addr, _, port = col.rpartition(":")
            return addr.strip("[]"), int(port)

        out = []
        for cols in self._ss(host, "-Htnp"):
            if len(cols) >= 5:
                pids = tuple(int(x) for x in re.findall(r"pid=(\d+)", " ".join(cols[5:])))
                out.append(Connection(split(cols[3]), split(cols[4]), pids))
        return out

    def _ss(self, host: Host, flags: str) -> list[list[str]]:
        res = subprocess.run(
            ["ip", "netns", "exec", host.name, "ss", flags], capture_output=True, text=True, check=True
        )
        return [line.split() for line in res.stdout.splitlines()]

    def listeners(self, host: Host) -> list[Listener]:
        """The TCP listening sockets in ``host`` (``ss -Hltnp`` there)."""
        out = []
        for cols in self._ss(host, "-Hltnp"):
            if len(cols) < 4:
                continue
            addr, _, port = cols[3].rpartition(":")
            users = " ".join(cols[5:])
            out.append(
                Listener(
                    addr=addr.strip("[]"),
                    port=int(port),
                    pids=tuple(int(x) for x in re.findall(r"pid=(\d+)", users)),
                    programs=tuple(re.findall(r'\("([^"]+)"', users)),
                )
            )
        return out

    def call_in(self, host: Host, fn: Callable[[], T]) -> T:
        """``fn()`` in a new thread that joined ``host``'s network namespace (sockets it opens are there);
        blocks until it returns. Only that thread changes namespace, and it ends with the call."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/run/netns/{host.name}", os.O_RDONLY)
                try:
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns into {host.name}: {os.strerror(err)}")
                finally:
                    os.close(fd)
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc

        t = threading.Thread(target=run, name=f"netns-{host.name}", daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    def close(self) -> None:
        """Stop every process (by PID, newest first), then delete every namespace (and so every veth, the bridge)."""
        for p in reversed(self.procs):
            try:
                self.stop(p, timeout_s=20)
            except Exception as exc:  # noqa: BLE001 - one that will not stop must not keep the others running
                log.error("netns.stop_failed", pid=p.pid, error=repr(exc))
        for f in self._logs:
            f.close()  # type: ignore[attr-defined]
        for h in self.hosts:  # what outlived its parent (a launcher's child in a session of its own): by PID
            for pid in self.pids(h) - {os.getpid()}:
                log.warning("netns.kill", pid=pid, reason=f"still inside {h.name} after its parents stopped")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for h in self.hosts:
            ip("netns", "del", h.name, check=False)
        ip("netns", "del", self.bridge, check=False)
        log.info("netns.closed", bridge=self.bridge, hosts=[h.name for h in self.hosts])


def build(n: int, *, prefix: str = PREFIX, subnet: str = SUBNET) -> Network:
    """Make the bridge namespace and ``n`` hosts ``<subnet>.1..n/24``; on failure, delete what was made."""
    if not 1 <= n <= 250:
        raise ValueError(f"1..250 hosts on one /24, got {n}")
    tag = f"{prefix}-{os.getpid()}-{next(_counter)}"
    net = Network(bridge=f"{tag}-br", hosts=[Host(f"{tag}-h{i}", f"{subnet}.{i + 1}", f"p{i}") for i in range(n)])
    try:
        ip("netns", "add", net.bridge)
        ip("-n", net.bridge, "link", "set", "lo", "up")
        ip("-n", net.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", net.bridge, "link", "set", "br0", "up")
        for h in net.hosts:
            ip("netns", "add", h.name)
            ip("-n", h.name, "link", "set", "lo", "up")
            ip("-n", net.bridge, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.name)
            ip("-n", net.bridge, "link", "set", h.port, "master", "br0")
            ip("-n", net.bridge, "link", "set", h.port, "up")
            ip("-n", h.name, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            ip("-n", h.name, "link", "set", "eth0", "up")
    except BaseException:
        net.close()
        raise
    log.info("netns.ready", bridge=net.bridge, hosts={h.name: h.addr for h in net.hosts})
    return net


@contextmanager
def network(n: int = 3, *, prefix: str = PREFIX, subnet: str = SUBNET) -> Iterator[Network]:
    """``n`` hosts on one bridge for the block (see the module docstring); everything made is removed after."""
    reap(prefix)
    net = build(n, prefix=prefix, subnet=subnet)
    try:
        yield net
    finally:
        net.close()
