"""Keys for NATS: the embedded server, started as ``cluster up`` starts it, takes only our users, each with its
role's permissions (transport/auth.py). Plain nats-py clients probe what each role may do; our transport runs
the real paths (publish with acks, durable consume, credit request/serve) with the roles' files."""

from __future__ import annotations

import asyncio
import stat
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import nats
import nats.errors
import pytest

from t1async.protocol import wire
from t1async.protocol.errors import ConfigError, TransportError
from t1async.transport import NatsConfig, NatsTransport, NoRespondersError
from t1async.transport.auth import NatsCreds, Role, creds_path, load_creds, make_server_auth, redact, secrets_dir
from t1async.transport.natscluster import ensure_replicas, start_embedded_server
from t1async.transport.natsd import NatsCluster


async def _up(stack: AsyncExitStack, run_dir: Path, *, tls: bool = False) -> str:
    """The NATS of ``cluster up``: per-role secrets, the embedded server requiring them, the streams made by admin."""
    auth = make_server_auth(secrets_dir(run_dir), tls=tls)
    srv = await start_embedded_server(stack, run_dir, 0, 1 << 20, auth)
    await ensure_replicas(srv.url, None, creds_path(run_dir, Role.ADMIN))
    return srv.url


def _creds(run_dir: Path, role: Role) -> NatsCreds:
    return load_creds(creds_path(run_dir, role))


class Probe:
    """A plain nats-py client; ``denied()`` waits for the server's permissions violations (told asynchronously)."""

    def __init__(self, url: str, creds: NatsCreds):
        self.url, self.creds, self.errors = url, creds, []
        self._seen = asyncio.Event()

    async def __aenter__(self):
        async def on_error(exc):
            self.errors.append(str(exc))
            self._seen.set()

        self.nc = await nats.connect(self.url, error_cb=on_error, allow_reconnect=False, **self.creds.connect_options())
        return self

    async def __aexit__(self, *exc):
        await self.nc.close()

    async def denied(self, what: str) -> bool:
        """The server refused ``what`` (nats-py lowercases what the server says)."""
        async with asyncio.timeout(30):
            while not any(f"permissions violation for {what}".lower() in e.lower() for e in self.errors):
                self._seen.clear()
                await self._seen.wait()
        return True


def run_asyncio(fn, *args):
    return anyio.to_thread.run_sync(asyncio.run, fn(*args))


async def test_secrets_are_private_and_no_credentials_is_refused(tmp_path):
    async with AsyncExitStack() as stack:
        url = await _up(stack, tmp_path)
        for role in Role:
            assert stat.S_IMODE(creds_path(tmp_path, role).stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "nats" / "nats-server.conf").stat().st_mode) == 0o600
        with pytest.raises(TransportError, match="refused us"):
            async with NatsTransport(config=NatsConfig(url=url, connect_timeout_s=5)):
                pass

        async def plain(url):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(url, allow_reconnect=False)
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(url, allow_reconnect=False, user="actor", password="guessed")

        await run_asyncio(plain, url)


async def test_an_actor_publishes_trajectories_but_cannot_consume_or_announce_policies(tmp_path):
    async with AsyncExitStack() as stack:
        url = await _up(stack, tmp_path)

        async def actor(url, creds):
            async with Probe(url, creds) as p:
                js = p.nc.jetstream(timeout=3)
                ack = await js.publish("t1.traj.x", b"anything")
                assert ack.stream == "T1_TRAJ"
                await p.nc.publish("t1.policy", b"a fake policy")
                assert await p.denied('publish to "t1.policy"')
                with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                    await js.pull_subscribe("t1.traj.>", durable="thief", stream="T1_TRAJ")
                assert await p.denied('publish to "$JS.API.CONSUMER.')
                await p.nc.subscribe("t1.traj.>")
                assert await p.denied('subscription to "t1.traj.>"')
                await p.nc.subscribe("_INBOX.learner.>")  # the learner's fetches come on its inbox: not ours
                assert await p.denied('subscription to "_INBOX.learner.>"')

        await run_asyncio(actor, url, _creds(tmp_path, Role.ACTOR))


async def test_the_reader_reads_and_cannot_publish(tmp_path):
    async with AsyncExitStack() as stack:
        url = await _up(stack, tmp_path)

        async def reader(url, creds, actor_creds):
            async with Probe(url, creds) as p, Probe(url, actor_creds) as a:
                sub = await p.nc.subscribe("t1.traj.>")
                await p.nc.flush()
                await a.nc.jetstream(timeout=3).publish("t1.traj.y", b"seen")
                assert (await sub.next_msg(timeout=10)).data == b"seen"
                await p.nc.publish("t1.traj.z", b"forged")
                assert await p.denied('publish to "t1.traj.z"')
                await p.nc.publish("t1.policy", b"forged")
                assert await p.denied('publish to "t1.policy"')

        await run_asyncio(reader, url, _creds(tmp_path, Role.READER), _creds(tmp_path, Role.ACTOR))


async def _learner_and_actor(url: str, run_dir: Path) -> None:
    """The real paths with the roles' files: an actor's acked publish and credit request, the learner's durable
    consume, ack and credit reply."""
    learner = NatsConfig(url=url, creds=creds_path(run_dir, Role.LEARNER))
    actor = NatsConfig(url=url, creds=creds_path(run_dir, Role.ACTOR))
    async with NatsTransport(config=learner) as lt, NatsTransport(config=actor) as at:
        await at.publish("t1.traj.ep1", wire.StartRecord("ep1", "actor-0", "task", 3, 0.0))
        async with lt.consume("learner") as batches:
            batch = await anext(batches)
            assert [(d.subject, d.record.episode, d.record.actor) for d in batch] == [("t1.traj.ep1", "ep1", "actor-0")]
            await batch.ack()
        async with lt.serve("t1.credit") as requests, anyio.create_task_group() as tg:

            async def answer():
                req = await anext(requests)
                await req.respond(wire.Heartbeat("learner", 1.0))

            tg.start_soon(answer)
            # on a cluster the learner's subscription reaches the other nodes over the routes a moment after it
            # is made, and a request through one of them meets no responder until then (a CI run failed so):
            # the actors' CreditClient retries that (credits/client.py), and so does this
            with anyio.fail_after(30):
                while True:
                    try:
                        reply = await at.request("t1.credit", wire.Heartbeat("actor-0", 0.0), timeout=20)
                        break
                    except NoRespondersError:
                        await anyio.sleep(0.1)
            assert isinstance(reply, wire.Heartbeat) and reply.actor == "learner"


async def test_learner_and_actor_work_with_their_credentials(tmp_path):
    async with AsyncExitStack() as stack:
        url = await _up(stack, tmp_path)
        await _learner_and_actor(url, tmp_path)
        reader = NatsConfig(url=url, creds=creds_path(tmp_path, Role.READER))
        async with NatsTransport(config=reader) as t, t.subscribe("t1.traj.>") as msgs:
            assert t.max_payload > 0  # tail's transport opens (stream info allowed) and subscribes
            del msgs


async def test_tls_with_the_generated_ca(tmp_path):
    async with AsyncExitStack() as stack:
        url = await _up(stack, tmp_path, tls=True)
        assert url.startswith("tls://")
        assert _creds(tmp_path, Role.ACTOR).ca_file == (tmp_path / "secrets" / "ca.pem").resolve()
        await _learner_and_actor(url, tmp_path)

        async def untrusted(url, creds):  # the right password, but no CA: the certificate is not trusted
            with pytest.raises((nats.errors.Error, OSError)):
                await nats.connect(url, allow_reconnect=False, user=creds.user, password=creds.password)

        await run_asyncio(untrusted, url, _creds(tmp_path, Role.ACTOR))


async def test_a_three_node_cluster_routes_with_its_own_user(tmp_path):
    auth = make_server_auth(secrets_dir(tmp_path))
    async with NatsCluster.start(tmp_path / "nats", 3, auth=auth) as cl:
        assert "route:" in (tmp_path / "nats" / "node-0" / "nats-server.conf").read_text()
        await ensure_replicas(cl.url, 3, creds_path(tmp_path, Role.ADMIN))  # needs every route up
        await _learner_and_actor(cl.url, tmp_path)


def test_credentials_files_and_urls(tmp_path):
    auth = make_server_auth(secrets_dir(tmp_path))
    again = make_server_auth(secrets_dir(tmp_path))  # kept: hosts it was copied to go on working
    assert auth.passwords == again.passwords and len({pw for _, pw in auth.passwords}) == len(Role)
    bad = tmp_path / "bad.json"
    bad.write_text('{"user": "x"}')
    with pytest.raises(ConfigError, match="not a credentials file"):
        load_creds(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_creds(tmp_path / "missing.json")
    jwt = tmp_path / "u.creds"
    jwt.write_text("-----BEGIN NATS USER JWT-----\nx\n------END NATS USER JWT------\n")
    assert load_creds(jwt).connect_options()["user_credentials"] == str(jwt)
    assert redact("nats://u:secret@a:4222,nats://b:4222") == "nats://u:***@a:4222,nats://b:4222"


async def test_cluster_tail_reads_with_the_runs_reader_file(tmp_path, repo_env):
    """``cluster tail --run-dir`` with neither --nats nor --nats-creds: the URL from cluster.json, the reader's file."""
    import signal
    import sys

    from t1async.cluster.state import ClusterState

    async with AsyncExitStack() as stack:
        url = await _up(stack, tmp_path)
        ClusterState(run_dir=str(tmp_path), status="running", nats_url=url).save()
        argv = [sys.executable, "-m", "t1async.cluster", "tail", "--run-dir", str(tmp_path), "--no-text", "--json"]
        async with await anyio.open_process(argv, env=repo_env) as proc:
            try:
                err, out = bytearray(), bytearray()
                with anyio.fail_after(90):
                    while b"# tailing" not in err:
                        err += await proc.stderr.receive()
                actor = NatsConfig(url=url, creds=creds_path(tmp_path, Role.ACTOR))
                async with NatsTransport(config=actor) as t:
                    await t.publish("t1.traj.ep-t", wire.StartRecord("ep-t", "actor-0", "task", 3, 0.0))
                with anyio.fail_after(60):
                    while b"ep-t" not in out:
                        out += await proc.stdout.receive()
                proc.send_signal(signal.SIGINT)
                with anyio.fail_after(10):
                    await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
        assert b'"kind": "start"' in out or b'"kind":"start"' in out, out


async def test_the_supervisor_starts_a_keyed_tls_nats_and_makes_the_streams_as_admin(tmp_path):
    """``cluster up --nats-tls``: secrets and a CA in the run dir, a tls:// URL, the streams made before any
    component (which may not make them) starts."""
    from t1async.cluster.state import ClusterState
    from t1async.cluster.supervisor import ClusterConfig, Supervisor

    run = tmp_path / "run"
    assert await Supervisor(ClusterConfig(run_dir=run, nats_auth=True, nats_tls=True, duration_s=0.5)).run() == 0
    assert ClusterState.load(run).nats_url.startswith("tls://127.0.0.1:")
    assert {p.name for p in (run / "secrets").iterdir()} >= {"ca.pem", "server.pem", "nats-actor.json"}
    assert stat.S_IMODE((run / "secrets" / "server.key").stat().st_mode) == 0o600
    assert list((run / "nats" / "jetstream").rglob("T1_TRAJ")), "the admin made the stream"


def test_a_node_on_its_own_host_takes_the_users_of_its_secrets_dir(tmp_path):
    """``python -m t1async.transport.natsd --secrets DIR``: the same users (and route password) on every host."""
    from t1async.transport.natsd import NatsNodeSettings, node_config

    first = node_config(NatsNodeSettings(store_dir=tmp_path / "a", secrets=tmp_path / "keys"))
    second = node_config(NatsNodeSettings(store_dir=tmp_path / "b", secrets=tmp_path / "keys"))
    assert first.auth is not None and first.auth == second.auth
    assert load_creds(tmp_path / "keys" / "nats-actor.json").user == "actor"
    assert node_config(NatsNodeSettings(store_dir=tmp_path / "c")).auth is None


def test_cluster_up_hands_each_child_its_roles_file(tmp_path):
    """The embedded NATS: each role's own file; an external one: --nats-creds for all; clear errors otherwise."""
    from t1async.cluster.components import nats_creds
    from t1async.cluster.config import UpConfig

    embedded = UpConfig(run_dir=tmp_path)
    assert nats_creds(embedded, Role.ACTOR) is None  # none made (yet): an open NATS
    make_server_auth(secrets_dir(tmp_path))
    assert nats_creds(embedded, Role.ACTOR) == creds_path(tmp_path, Role.ACTOR)
    assert nats_creds(embedded, Role.LEARNER) == creds_path(tmp_path, Role.LEARNER)
    external = UpConfig(run_dir=tmp_path, nats="nats://h:4222", nats_creds=tmp_path / "mine.json")
    assert nats_creds(external, Role.ACTOR) == nats_creds(external, Role.LEARNER) == tmp_path / "mine.json"
    with pytest.raises(ConfigError, match="--nats-tls"):
        UpConfig(run_dir=tmp_path, nats="nats://h:4222", nats_tls=True).check()
    with pytest.raises(ConfigError, match="--nats-creds is for an external --nats"):
        UpConfig(run_dir=tmp_path, nats_creds=tmp_path / "mine.json").check()
