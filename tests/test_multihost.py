"""Three hosts for real on one machine (design §10): three network namespaces on a bridge, each running one
node of one 3-node NATS JetStream cluster, with the learner on hosts A and B (rank 0, the service, on A; rank 1
on B; one torchrun each), the sampler on host B and the actors on host C. Every process is started with the
documented multi-host commands and told its own address. Training goes on, host C's link is cut for 20 s,
training goes on again, and the stream read back shows nothing lost and nothing trained twice. Needs root
(network namespaces), as the sandbox tests do; CI runs as root."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest

from bench.multihost import ACTOR, HTTP_PORT, NATS_PORT, RDZV_PORT, ROUTE_PORT, SAMPLER_PORT, Plan, run
from t1async.procs import pid_alive
from t1async.testing.netns import namespaces, network, reap, unavailable

needs_root = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@needs_root
def test_namespaces_are_made_joined_and_removed_and_a_cut_cuts():
    before = namespaces()
    with network(3) as net:
        a, b, c = net.hosts
        assert [h.addr for h in net.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        assert set(namespaces()) - set(before) == {net.bridge, a.name, b.name, c.name}
        srv = net.run_in(
            b,
            [
                sys.executable,
                "-c",
                "import socket,time;s=socket.socket();s.bind(('198.18.0.2',7000));s.listen(8);time.sleep(600)",
            ],
        )

        def reach(host: str = "198.18.0.2") -> bool:
            try:
                socket.create_connection((host, 7000), timeout=1.5).close()
                return True
            except OSError:
                return False

        t_end = time.monotonic() + 30
        while not net.listeners(b) and time.monotonic() < t_end:
            time.sleep(0.1)
        assert [(x.addr, x.port, x.pids) for x in net.listeners(b)] == [("198.18.0.2", 7000, (srv.pid,))]
        assert net.call_in(a, reach), "host A reaches host B over the bridge"
        net.set_link(b, False)
        try:
            assert not net.call_in(a, reach), "with B's cable out, A cannot reach it"
        finally:
            net.set_link(b, True)
        assert net.call_in(c, reach), "and with it back, C can"
        assert not net.call_in(a, lambda: reach("127.0.0.1")), "a host's loopback is its own"
    assert srv.poll() is not None, "the process started in a host was stopped by PID"
    assert namespaces() == before, "every namespace (and so every veth and the bridge) is gone"


@needs_root
def test_an_error_inside_the_block_still_removes_everything():
    before = namespaces()
    with pytest.raises(RuntimeError, match="boom"), network(2) as net:
        p = net.run_in(net.hosts[0], ["sleep", "600"])
        raise RuntimeError("boom")
    assert p.returncode is not None and namespaces() == before


@needs_root
def test_reap_deletes_what_a_dead_run_left_only():
    p = subprocess.Popen(["true"])
    p.wait()  # its PID no longer runs: what a killed run left
    stale, live = f"t1mh-{p.pid}-0-h0", f"t1mh-{os.getpid()}-99-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    subprocess.run(["ip", "netns", "add", live], check=True)
    left = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"], start_new_session=True)
    try:
        gone = reap()
        assert stale in gone and live not in gone
        assert live in namespaces() and stale not in namespaces()
        assert left.wait(timeout=30) == -9, "the dead run's process inside was stopped"
    finally:
        if left.poll() is None:
            left.kill()
        for n in (stale, live):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_a_nats_node_command_says_what_is_missing(repo_env):
    def natsd(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "t1async.transport.natsd", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=repo_env, timeout=60)

    res = natsd("--host", "198.18.0.1", "--routes", "198.18.0.2:6222")
    assert res.returncode == 2 and "error: no store: pass --store-dir DIR" in res.stderr
    res = natsd("--store-dir", "/tmp/x", "--routes", "198.18.0.2:6222")
    assert res.returncode == 2 and "needs a name: pass --server-name" in res.stderr
    res = natsd("--store-dir", "/tmp/x", "--server-name", "t1-0", "--routes", "198.18.0.2")
    assert res.returncode == 2 and "--routes entry '198.18.0.2' is not HOST:PORT" in res.stderr


def test_a_nats_node_command_runs_a_lone_node_until_sigterm(tmp_path, repo_env):
    from t1async.transport.natsd import free_port

    port, http = free_port(), free_port()
    ready = tmp_path / "url"
    argv = [sys.executable, "-m", "t1async.transport.natsd", "--port", str(port), "--http-port", str(http)]
    argv += ["--store-dir", str(tmp_path / "nats"), "--ready-file", str(ready)]
    p = subprocess.Popen(argv, env=repo_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t_end = time.monotonic() + 60
        while not ready.exists() and p.poll() is None and time.monotonic() < t_end:
            time.sleep(0.1)
        assert ready.read_text().strip() == f"nats://127.0.0.1:{port}"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        conf = (tmp_path / "nats" / "nats-server.conf").read_text()
        assert f"listen: 127.0.0.1:{port}" in conf and "cluster" not in conf
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "t1async nats-server ready at" in out


@needs_root
@pytest.mark.slow
def test_three_hosts_train_through_a_20s_cut_of_the_actors_host(tmp_path):
    out = run(Plan(cut_s=20.0, versions_before=2, versions_after=2), tmp_path)
    logs = tmp_path / "logs"

    def tail(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")[-2000:]

    assert out.namespaces_after == out.namespaces_before, "the run left no namespace behind"
    # the learner spans two hosts (one torchrun each): rank 0, the service, runs inside host A's namespace and
    # rank 1 inside host B's, and each has its own gloo listener on its own host's address
    a, b = out.hosts["A"], out.hosts["B"]
    assert out.rank_hosts == {0: "A", 1: "B"}, (out.rank_pids, tail("learner-1"))
    rank_listeners = {
        r: [(x.addr, x.port) for x in out.listeners[role] if out.rank_pids[r] in x.pids]
        for r, role in out.rank_hosts.items()
    }
    assert rank_listeners[0] and all(addr == a for addr, _ in rank_listeners[0]), rank_listeners
    assert rank_listeners[1] and all(addr == b for addr, _ in rank_listeners[1]), rank_listeners
    # ... and gloo connected them across the bridge: a TCP link between rank 0 in A and one of rank 1's
    # listening ports in B, or from rank 1 in B to one of rank 0's (whichever side gloo had dial)
    gloo = [x for x in out.rank_links[0] if x.peer in rank_listeners[1] or x.local in rank_listeners[0]]
    assert gloo and all(x.local[0] == a and x.peer[0] == b for x in gloo), out.rank_links
    assert any(x.peer[0] == a for x in out.rank_links[1]), out.rank_links
    # both ranks trained every step (FSDP over the two hosts), and neither outlived the run
    dist_steps = [e for e in out.events if e.get("event") == "learner.dist_step"]
    assert len(dist_steps) >= out.version_at_end and all(e["ranks"] == 2 for e in dist_steps), dist_steps[-1:]
    assert not [pid for pid in out.rank_pids.values() if pid_alive(pid)], out.rank_pids
    # every process listens on its host's address, none on loopback (unreachable from the other hosts); the one
    # exception is torch's rendezvous store (torchrun on A), which binds the wildcard: inside host A's
    # namespace that is only its loopback and its bridge address
    for role, addr in out.hosts.items():
        got = {(x.addr, x.port) for x in out.listeners[role] if not set(x.pids) & set(out.rank_pids.values())}
        want = {(addr, NATS_PORT), (addr, ROUTE_PORT), (addr, HTTP_PORT)} | (
            {(addr, SAMPLER_PORT)} if role == "B" else set()
        )
        if role == "A":
            want.add(("*", RDZV_PORT))
        assert got == want, f"host {role} listens on {sorted(got)}, expected {sorted(want)}"
    store = [x for x in out.listeners["A"] if x.port == RDZV_PORT]
    assert [x.pids for x in store] == [(out.pids["learner"],)], store
    for name, argv in out.commands.items():
        assert "127.0.0.1" not in " ".join(argv) and "localhost" not in " ".join(argv), name

    # training went on before the cut, with turns from the actors' host
    assert out.version_at_cut >= 2 and out.turns_before_cut
    assert all(ep.startswith(f"{ACTOR}-") for ep, _ in out.turns_before_cut)
    # the cut: the learner saw host C go silent, released its credits, ended its open episodes
    assert out.cut_s >= 20.0
    silent = [e for e in out.events if e.get("event") == "learner.actor_silent"]
    assert [e["actor"] for e in silent] == [f"{ACTOR}-0"], tail("learner")
    assert silent[0]["credits_released"] + silent[0]["episodes_aborted"] >= 1
    # and after it: a turn the learner received only after the link came back was trained, 2 more versions
    assert out.recover_s is not None, tail("actor-0")
    assert out.version_at_end >= out.version_at_cut + 2
    after = set(out.trained) - out.turns_before_cut
    assert any(ep.startswith(f"{ACTOR}-") for ep, _ in after)

    # nothing lost, nothing trained twice, nothing stored twice (in a stream the learner made with 3 replicas)
    assert out.replicas == {"T1_TRAJ": 3, "T1_DEAD": 3}
    assert out.undecodable == 0
    assert len(out.stream_ids) == len(set(out.stream_ids)), "a turn message is stored once in T1_TRAJ"
    assert out.stream_turns and not out.lost, f"lost: {sorted(out.lost)[:5]}"
    assert not out.twice, f"trained twice: {out.twice[:5]}"
    assert set(out.trained) <= set(out.stream_turns), "every trained turn came through the stream"
    assert all(reason for reason, _ in out.dead), f"a dead letter without a reason: {out.dead}"
    # the learner's own count: every turn it took is settled once (trained, abandoned, ...) or still open
    settled, open_ = out.metrics["settled"], out.metrics["untrained_turns"]
    assert sum(settled.values()) + open_ == len(set(out.stream_turns)), (settled, open_, len(set(out.stream_turns)))
    assert settled["trained"] <= len(out.trained)
    assert out.exit_codes["learner"] == 0 and out.exit_codes["learner-1"] == 0, out.exit_codes
    assert out.exit_codes["sampler"] == 0, out.exit_codes
    assert all(out.exit_codes[f"nats-{i}"] == 0 for i in range(3)), out.exit_codes


@needs_root
def test_a_weight_update_group_spans_two_hosts():
    """The learner (rank 0, store on host A) and a sampler (rank 1, host B) join one gloo group and a tensor
    crosses: gloo's sockets are on the address that reaches the store, not the loopback its hostname gives."""
    import threading

    import torch

    from t1async.sampler.weightpush import broadcast, open_group, store_master
    from t1async.transport.natsd import free_port

    got: dict[str, object] = {}
    with network(2) as net:
        a, b = net.hosts
        port = net.call_in(a, lambda: free_port(a.addr))

        def rank(i: int) -> None:
            def join() -> torch.Tensor:
                store = store_master(a.addr, port, 2, 30) if i == 0 else None
                pg = open_group(store, host=a.addr, port=port, rank=i, world_size=2, group_name="g", timeout_s=30)
                t = torch.arange(4, dtype=torch.float32) if i == 0 else torch.zeros(4)
                broadcast(pg, [t])
                return t

            try:
                got[str(i)] = net.call_in(net.hosts[i], join)
            except Exception as exc:  # noqa: BLE001 - reported below
                got[f"error{i}"] = exc

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert "error0" not in got and "error1" not in got, got
    assert torch.equal(got["1"], torch.arange(4, dtype=torch.float32))  # type: ignore[arg-type]


@needs_root
def test_a_rank_puts_gloo_on_its_own_address_on_the_way_to_rank_0():
    """gloo's default address is the one the hostname resolves to (127.0.0.1 here): rank 1 on host B would
    tell rank 0 on A to dial its loopback. ``ranks.join`` sets ``GLOO_SOCKET_IFNAME`` to the interface holding
    B's address on the route to rank 0's store; a store on loopback (one host) leaves gloo's default."""
    from t1async.learner.ranks import gloo_interface

    with network(2) as net:
        a, b = net.hosts
        assert net.call_in(b, lambda: gloo_interface(a.addr)) == "eth0"
        assert net.call_in(b, lambda: gloo_interface(b.addr)) == "eth0"
        assert net.call_in(b, lambda: gloo_interface("127.0.0.1")) is None


def test_learner_serve_under_an_outside_torchrun_runs_as_that_rank(monkeypatch, tmp_path, capsys):
    """On several hosts each host's torchrun starts ``learner serve`` without ``--nproc``: the world is torchrun's,
    so rank 1 joins and follows rank 0 (it used to start a second learner service on the same run dir) and
    rank 0 joins and is the service; a ``--nproc`` that disagrees with torchrun's WORLD_SIZE fails in one line."""
    from t1async.learner import ranks, serve_cli
    from t1async.learner.__main__ import main

    calls: list[str] = []
    monkeypatch.setattr(ranks, "follower_setup", lambda threads: calls.append("setup"))
    monkeypatch.setattr(ranks, "join", lambda backend: calls.append(f"join {backend}") or (0, 2))
    monkeypatch.setattr(ranks, "follow", lambda: calls.append("follow") or 0)
    monkeypatch.setattr(ranks, "die_with_parent", lambda sig: None)
    monkeypatch.setattr(serve_cli, "_serve", lambda c: calls.append("service") or 0)
    for k, v in {"TORCHELASTIC_RUN_ID": "t", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    argv = ["serve", "--run-dir", str(tmp_path), "--nats", "nats://198.18.0.1:4222"]
    assert main(argv) == 0 and calls == ["setup", "join gloo", "follow"]
    calls.clear()
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 0 and calls == ["join gloo", "service"]
    calls.clear()
    assert main([*argv, "--nproc", "3"]) == 2 and calls == []
    assert "error: --nproc 3 but torchrun started 2 ranks (WORLD_SIZE)" in capsys.readouterr().err


def test_the_read_back_waits_out_an_election_and_gives_up_after_its_wait():
    """After the cut, the stream's replicas may elect again and JetStream answers 503 until they have: the
    read-back asks again (a CI run failed on the first 503), but not for ever."""
    from nats.js.errors import ServiceUnavailableError

    from bench.multihost import _answered

    calls = []

    async def electing_twice() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise ServiceUnavailableError(code=503, err_code=10008, description="temporarily unavailable")
        return "info"

    async def never() -> str:
        raise ServiceUnavailableError(code=503, err_code=10008, description="temporarily unavailable")

    async def main() -> None:
        assert await _answered(electing_twice, wait_s=30, pause_s=0) == "info"
        assert len(calls) == 3
        with pytest.raises(ServiceUnavailableError):
            await _answered(never, wait_s=0.05, pause_s=0.01)

    asyncio.run(main())
