"""``cluster up --nats-nodes N`` and ``--stream-replicas R``: the supervisor's NATS JetStream cluster.

``start_embedded_cluster`` starts N nats-server nodes routed into one JetStream cluster (t1async.transport.natsd.
NatsCluster: a unique server_name, a cluster {name, listen, routes} block and a store dir each, under
<run-dir>/nats/node-<i>), tells its caller each node (the supervisor records it in cluster.json as ``nats-<i>``:
the transport knows nothing of the cluster's state), and restarts a node that dies (same ports, same store: it
rejoins). ``ensure_replicas`` creates T1_TRAJ (and T1_DEAD) with R replicas, or scales existing streams to R,
before any component starts; the components then find the streams as they are.
Every component gets all N URLs (``nats://a,nats://b,nats://c``): nats-py fails over between them.
``start_embedded_server`` is the one-node case (``cluster up`` without ``--nats-nodes``). With ``auth``
(transport/auth.py) the servers take only our users, each with its role's permissions, and with TLS when
it has a certificate; the routes between nodes have their own user.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

from t1async.log import get_logger
from t1async.protocol.errors import TransportError
from t1async.transport import NatsConfig, NatsTransport
from t1async.transport.auth import ServerAuth, redact
from t1async.transport.base import TRAJ_STREAM
from t1async.transport.natsd import NatsCluster, NatsServer

log = get_logger("cluster.nats")


def default_replicas(nodes: int, replicas: int, external: bool) -> int | None:
    """The stream replica count to ensure: the flag, else min(nodes, 3) for an embedded cluster, else None
    (an external NATS: leave an existing stream as it is)."""
    if replicas > 0:
        return replicas
    if external or nodes <= 1:
        return None
    return min(nodes, 3)


async def start_embedded_cluster(
    stack: AsyncExitStack,
    run_dir: Path,
    nodes: int,
    max_payload: int,
    on_node: Callable[[str, int, str], None],
    auth: ServerAuth | None = None,
) -> NatsCluster:
    """Start the cluster inside ``stack`` (stopped when it closes, after its watcher) and return it (``.url``
    lists every node). ``on_node(name, pid, log_path)`` is told each node as it starts and each restart."""
    cl = await stack.enter_async_context(
        NatsCluster.start(run_dir / "nats", nodes, max_payload=max_payload, log_dir=run_dir / "logs", auth=auth)
    )

    def record(i: int) -> None:
        node = cl.nodes[i]
        on_node(f"nats-{i}", node.pid or 0, str(node.log_path))

    for i in range(nodes):
        record(i)
    tg = await stack.enter_async_context(anyio.create_task_group())
    stack.callback(tg.cancel_scope.cancel)  # runs first on exit: the watcher stops, then the nodes
    tg.start_soon(cl.watch, 1.0, record)
    log.info("cluster.nats_cluster", nodes=nodes, urls=cl.url)
    return cl


async def start_embedded_server(
    stack: AsyncExitStack, run_dir: Path, port: int, max_payload: int, auth: ServerAuth | None = None
) -> NatsServer:
    """The single embedded nats-server inside ``stack`` (store <run-dir>/nats, log <run-dir>/logs)."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return await stack.enter_async_context(
        NatsServer.start(
            run_dir / "nats",
            port=port,
            max_payload=max_payload,
            log_file=run_dir / "logs" / "nats-server.log",
            auth=auth,
        )
    )


async def ensure_replicas(url: str, replicas: int | None, creds: Path | None = None) -> None:
    """Create the T1 streams with ``replicas`` replicas, or scale existing ones to it (a clear error if the
    NATS behind ``url`` has fewer JetStream servers); None: create them if missing, as they are if not.
    ``creds``: the admin's, where the components' own may not create streams."""
    async with NatsTransport(config=NatsConfig(url=url, stream_replicas=replicas, creds=creds)) as t:
        if replicas:
            await wait_replicated(t, replicas)
    log.info("cluster.stream_replicas", replicas=replicas, url=redact(url))


async def wait_replicated(t: NatsTransport, replicas: int, timeout_s: float = 60.0, stream: str = TRAJ_STREAM) -> None:
    """Until ``stream`` has a leader and ``replicas - 1`` current followers (a new or scaled stream elects first)."""
    import nats.errors

    last = "no answer"
    with anyio.move_on_after(timeout_s):
        while True:
            try:
                info = await t.stream_info(stream)
                peers = (info.cluster.replicas or []) if info.cluster else []
                settled = info.cluster.leader and len(peers) == replicas - 1 and all(p.current for p in peers)
                if replicas <= 1 or settled:
                    return
                last = f"leader {info.cluster.leader}, followers {[(p.name, p.current) for p in peers]}"
            except nats.errors.Error as exc:
                last = repr(exc)
            await anyio.sleep(0.2)
    raise TransportError(
        f"stream {stream} did not get {replicas} current replicas within {timeout_s:.0f}s ({last}): "
        "see the nats-server logs in <run-dir>/logs"
    )
