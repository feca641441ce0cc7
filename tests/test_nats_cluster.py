"""A NATS JetStream cluster (design §10): three real nats-server nodes, T1_TRAJ with 3 replicas.

Losing one node loses nothing and publishing goes on; with two down, publishes fail loudly (logged), are
retried with the same Nats-Msg-Id, and land exactly once when quorum returns; a restarted node rejoins.
And ``cluster up --nats-nodes 3`` keeps training while a node is SIGKILLed; the supervisor brings it back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import httpx
import pytest
from structlog.testing import capture_logs

from t1async.cluster.config import UpConfig
from t1async.cluster.state import ClusterState, is_ours
from t1async.procs import pid_alive
from t1async.protocol import wire
from t1async.protocol.errors import ConfigError, TransportError
from t1async.testing.harness import turn
from t1async.transport import NatsConfig, NatsTransport, traj_subject
from t1async.transport.auth import Role, creds_path
from t1async.transport.natscluster import start_embedded_cluster, wait_replicated
from t1async.transport.natsd import NatsCluster, NatsServer
from tests.cluster_watch import check_episode_turns, wait_running
from tests.clusterargs import SMALL, stop_cluster, up_argv


def fast(url: str, replicas: int | None = 3) -> NatsConfig:
    return NatsConfig(
        url=url, ack_timeout_s=1.0, retry_wait_s=0.1, reconnect_wait_s=0.1, ack_wait_s=5.0, stream_replicas=replicas
    )


async def get_json(url: str) -> dict:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
        return (await c.get(url)).json()


async def stream_info(t: NatsTransport, name: str = "T1_TRAJ"):
    return await t.stream_info(name)


async def test_three_nodes_have_unique_names_routes_and_a_store_each(tmp_path):
    async with NatsCluster.start(tmp_path / "nats", 3) as cl:
        assert cl.url == ",".join(n.url for n in cl.nodes) and len(set(cl.urls)) == 3
        names = set()
        for node in cl.nodes:
            varz = await get_json(f"{node.monitor_url}/varz")
            names.add(varz["server_name"])
            assert varz["cluster"]["name"] == "t1"
            assert varz["jetstream"]["config"]["store_dir"] == str(node.config.store_dir.resolve() / "jetstream")
            routez = await get_json(f"{node.monitor_url}/routez")
            assert {r["remote_name"] for r in routez["routes"]} == {f"t1-{j}" for j in range(3)} - {varz["server_name"]}
        assert names == {"t1-0", "t1-1", "t1-2"}
        assert len({n.config.store_dir for n in cl.nodes}) == 3
        pids = [n.pid for n in cl.nodes]
    assert not any(pid_alive(p) for p in pids), "every node is stopped by PID"


async def test_the_stream_gets_three_replicas_and_a_single_server_says_it_cannot(tmp_path):
    async with NatsCluster.start(tmp_path / "c", 3) as cl:
        async with NatsTransport(config=fast(cl.url, None)) as t:  # created as before: one replica
            assert (await stream_info(t)).config.num_replicas == 1
        async with NatsTransport(config=fast(cl.url, 3)) as t:  # the flag scales it
            await wait_replicated(t, 3)
            info = await stream_info(t)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
            assert (await stream_info(t, "T1_DEAD")).config.num_replicas == 3
    async with NatsServer.start(tmp_path / "one") as srv:
        with pytest.raises(TransportError, match=r"cannot keep stream T1_TRAJ with 3 replicas.*--stream-replicas 1"):
            async with NatsTransport(config=fast(srv.url, 3)):
                pass


async def test_the_embedded_cluster_tells_its_caller_each_node_and_each_restart(tmp_path):
    """The supervisor records the nodes in cluster.json; the transport-side code only calls back."""
    told: list[tuple[str, int, str]] = []
    (tmp_path / "logs").mkdir()  # the supervisor makes it
    async with AsyncExitStack() as stack:
        cl = await start_embedded_cluster(stack, tmp_path, 2, 1 << 20, lambda *node: told.append(node))
        assert [t[0] for t in told] == ["nats-0", "nats-1"] and cl.url == ",".join(n.url for n in cl.nodes)
        assert [t[1] for t in told] == [n.pid for n in cl.nodes] and all(pid_alive(t[1]) for t in told)
        assert [t[2] for t in told] == [str(n.log_path) for n in cl.nodes]
        first = cl.nodes[1].pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        with anyio.fail_after(30):
            while len(told) < 3:
                await anyio.sleep(0.1)
        assert told[2][0] == "nats-1" and told[2][1] == cl.nodes[1].pid != first
        pids = [n.pid for n in cl.nodes]
    assert not any(pid_alive(p) for p in pids), "the nodes stop with the stack"


def test_cluster_flags_are_checked():
    assert UpConfig(nats_nodes=3, stream_replicas=3).check().nats_nodes == 3
    with pytest.raises(ConfigError, match=r"--stream-replicas 3 needs as many NATS servers.*--nats-nodes 3"):
        UpConfig(stream_replicas=3).check()
    with pytest.raises(ConfigError, match=r"--nats-nodes 3 starts an embedded cluster, --nats uses an external"):
        UpConfig(nats="nats://a:4222", nats_nodes=3).check()
    with pytest.raises(ConfigError, match=r"--nats-port .* drop --nats-port"):
        UpConfig(nats_nodes=3, nats_port=4222).check()
    with pytest.raises(ConfigError, match=r"--stream-replicas must be 1..5"):
        UpConfig(nats="nats://a:4222", stream_replicas=7).check()
    assert UpConfig(nats="nats://a:4222,nats://b:4222,nats://c:4222", stream_replicas=3).check()


@pytest.mark.slow
async def test_one_node_down_then_two_nothing_admitted_is_lost_or_duplicated(tmp_path):
    n, published, received = 600, [], []
    seen: dict[str, int] = {}
    quorum_lost = anyio.Event()  # the second half is published only once two nodes are down
    async with NatsCluster.start(tmp_path / "nats", 3) as cl:
        async with NatsTransport(config=fast(cl.url)) as pub, NatsTransport(config=fast(cl.url)) as sub:

            async def publisher(lane: int) -> None:
                for k in range(lane, n, 4):
                    if k >= n // 2:
                        await quorum_lost.wait()
                    await pub.publish(traj_subject(f"ep{lane}"), turn(f"ep{lane}", k))
                    published.append(k)
                    await anyio.sleep(0.01)

            async def consumer() -> None:
                async with sub.consume("learner", max_wait_s=0.3) as batches:
                    async for batch in batches:
                        received.extend(d.record.turn for d in batch)
                        await batch.ack()
                        if len(received) >= n:
                            return

            async def faults() -> None:
                while len(published) < n // 5:
                    await anyio.sleep(0.01)
                await cl.kill(0)  # one of three: the stream keeps its quorum
                mark = len(published)
                with anyio.fail_after(60):
                    while len(published) < mark + 60:
                        await anyio.sleep(0.01)
                seen["one_down"] = len(published) - mark
                await cl.restart(0)
                await cl.wait_healthy(60)  # /healthz on every node: routed, JetStream current again
                async with NatsTransport(cl.url) as t:  # node 0's replica is current again (or it leads)
                    await wait_replicated(t, 3, 60)
                with anyio.fail_after(60):
                    while len(published) < n // 2:
                        await anyio.sleep(0.05)
                with capture_logs() as logs:
                    await cl.kill(1)
                    await cl.kill(2)  # no quorum: no publish can be acknowledged
                    quorum_lost.set()
                    mark, t0 = len(published), anyio.current_time()
                    while anyio.current_time() - t0 < 3 or (  # 3 s at least, until a retry was logged (20 s at most)
                        not any(e["event"] == "transport.publish_retry" for e in logs)
                        and anyio.current_time() - t0 < 20
                    ):
                        await anyio.sleep(0.25)
                    seen["two_down"] = len(published) - mark
                    seen["retries"] = sum(e["event"] == "transport.publish_retry" for e in logs)
                await cl.restart(1)
                await cl.restart(2)

            with anyio.fail_after(180):
                async with anyio.create_task_group() as tg:
                    for lane in range(4):
                        tg.start_soon(publisher, lane)
                    tg.start_soon(faults)
                    tg.start_soon(consumer)
            await cl.wait_healthy(60)  # the restarted nodes may still be electing: JetStream API calls time out
            async with NatsTransport(cl.url) as t:
                stored = (await stream_info(t)).state.messages
    assert seen["one_down"] >= 60, "publishing went on with one node down"
    assert seen["two_down"] <= 4 and seen["retries"] >= 1, f"without quorum, publishes failed loudly: {seen}"
    assert len(published) == n
    assert sorted(received) == list(range(n)), f"missing {set(range(n)) - set(received)}, {len(received) - n} extra"
    assert stored == n, "the stream holds each record once, retries included"


# ---------------------------------------------------------------------------------------------- cluster up


def _monitor(run_dir: Path, i: int) -> str:
    conf = (run_dir / "nats" / f"node-{i}" / "nats-server.conf").read_text()
    return "http://" + re.search(r"^http: (\S+)$", conf, re.M).group(1)


@pytest.mark.slow
async def test_cluster_up_with_three_nodes_trains_through_a_node_kill(tmp_path, repo_env):
    run_dir = tmp_path / "run"
    argv = [
        *up_argv(run_dir),
        "--nats-nodes",
        "3",
        *SMALL,
        "--duration",
        "400",
        "--plain",
    ]
    out = open(tmp_path / "up.out", "w")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=repo_env, start_new_session=True)
    try:
        st = await wait_running(run_dir, proc)
        assert st.nats_url.count("nats://") == 3 and {f"nats-{i}" for i in range(3)} <= st.components.keys()
        async with (
            NatsTransport(config=NatsConfig(url=st.nats_url, creds=creds_path(run_dir, Role.ADMIN))) as t,
            t.subscribe("t1.policy") as policies,
        ):
            info = await stream_info(t)
            assert info.config.num_replicas == 3
            with anyio.fail_after(240):
                async for m in policies:
                    if m.record.policy_version >= 2:
                        break
            leader = int((await stream_info(t)).cluster.leader.rsplit("-", 1)[1])
            victim = st.components[f"nats-{leader}"]
            os.kill(victim.pid, signal.SIGKILL)  # the stream's leader, mid-run
            killed_at = m.record.policy_version
            with anyio.fail_after(240):
                async for m in policies:
                    if m.record.policy_version >= killed_at + 3:
                        break  # training went on
            back = ClusterState.load(run_dir).components[f"nats-{leader}"]
            assert back.pid != victim.pid and is_ours(back), "the supervisor restarted the killed node"
            assert (await get_json(f"{_monitor(run_dir, leader)}/healthz")) == {"status": "ok"}, "and it rejoined"
            # the replicated stream, read back: every turn once, no episode with a gap
            last = (await stream_info(t)).state.last_seq
            turns: dict[str, list[wire.TurnRecord]] = {}
            ids: list[str] = []
            with anyio.fail_after(60):
                async with t.consume("h11-reader", batch=256, max_wait_s=0.5) as batches:
                    async for batch in batches:
                        for d in batch:
                            ids.append(d.msg_id)
                            if isinstance(d.record, wire.TurnRecord):
                                turns.setdefault(d.record.episode, []).append(d.record)
                        await batch.ack()
                        if max(d.stream_seq for d in batch) >= last:
                            break
        assert len(ids) == len(set(ids)), "no record is stored twice"
        assert len(turns) >= 2
        for ep_turns in turns.values():
            check_episode_turns(ep_turns)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        stop_cluster(proc, run_dir, 60)
        out.close()
    log = (tmp_path / "up.out").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert ClusterState.load(run_dir).status == "stopped"
    assert not any(is_ours(p) for p in [victim, back])


async def test_supervisor_scales_the_stream_of_an_external_cluster(tmp_path):
    """``cluster up --nats a,b,c --stream-replicas 3``: the stream is made R3 before any component starts."""
    from t1async.cluster.supervisor import ClusterConfig, Supervisor

    async with NatsCluster.start(tmp_path / "ext", 3) as cl:
        async with NatsTransport(config=fast(cl.url, None)) as t:  # an older run made it with one replica
            assert (await stream_info(t)).config.num_replicas == 1
        sup = Supervisor(ClusterConfig(run_dir=tmp_path / "run", nats_url=cl.url, stream_replicas=3, duration_s=0.5))
        assert await sup.run() == 0
        assert ClusterState.load(tmp_path / "run").nats_url == cl.url
        async with NatsTransport(config=fast(cl.url, None)) as t:
            info = await stream_info(t)
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
