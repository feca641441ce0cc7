"""Many samplers (design §10): episodes pinned to one sampler under a load cap; a dead sampler is taken out and
its episodes go on elsewhere, routes from where the new sampler recomputed; it comes back healthy and at the
current weight version. The pool's rules on their own, then two real embedded samplers, one SIGKILLed."""

from __future__ import annotations

import os
import signal

import anyio
import numpy as np
import pytest
from structlog.testing import capture_logs

from t1async.model.weights import default_model_dir
from t1async.protocol.sampling import SamplingParams
from t1async.sampler.client import SGLangClient
from t1async.sampler.launch import SamplerProcess
from t1async.sampler.pool import PoolConfig, SamplerPool
from t1async.transport.natsd import free_port
from tests.benchcli import bench
from tests.cluster_watch import check_episode_turns, wait_running
from tests.clusterargs import SMALL, stop_cluster, up_argv


def pool(n: int = 2, cap: int = 2) -> SamplerPool:
    urls = [f"http://s{i}" for i in range(n)]
    return SamplerPool(urls, {u: 0 for u in urls}, PoolConfig(load_cap=cap))


def test_an_episode_stays_on_its_sampler_and_new_ones_spread():
    p = pool()
    first = {f"ep{i}": p.pick(f"ep{i}") for i in range(4)}
    assert set(first.values()) == {"http://s0", "http://s1"}, "new episodes spread over idle samplers"
    p.outstanding["http://s0"] = 1  # the other is less loaded now, but a pinned episode does not move
    assert all(p.pick(ep) == url for ep, url in first.items() for _ in range(3))


def test_the_load_cap_moves_new_episodes_off_a_saturated_sampler_only():
    p = pool(cap=2)
    assert p.pick("old") == "http://s0"
    p.outstanding.update({"http://s0": 2, "http://s1": 1})  # s0 at the cap
    assert p.pick("new-1") == "http://s1" and p.pick("old") == "http://s0"
    p.outstanding.update({"http://s0": 5, "http://s1": 2})  # both saturated: the least loaded
    assert p.pick("new-2") == "http://s1"


def test_a_dead_sampler_is_taken_out_and_comes_back_at_the_current_version():
    p = pool()
    assert p.pick("ep") == "http://s0"
    p.mark_down("http://s0", "refused")
    assert p.pick("ep") == "http://s1" and p.moved == 1 and p.pick("ep") == "http://s1"

    state = {"http://s0": (True, 0), "http://s1": (True, 3)}

    async def probe(u):
        return state[u]

    async def rounds():
        await p.probe_all(probe)
        assert "http://s0" not in p.live, "healthy, but at version 0 while the live samplers serve 3"
        state["http://s0"] = (True, 3)
        await p.probe_all(probe)
        assert "http://s0" in p.live
        state["http://s1"] = (False, None)
        await p.probe_all(probe)
        assert p.live == {"http://s0"}

    anyio.run(rounds)


@pytest.mark.slow
async def test_sigkill_one_of_two_samplers_mid_run_no_turn_is_lost(tmp_path):
    ports = [free_port(), free_port()]
    procs = [SamplerProcess(port=p, log_path=tmp_path / f"s{i}.log") for i, p in enumerate(ports)]
    n_eps, n_turns, kill_after = 4, 8, 3
    turns: dict[str, list] = {f"ep{i}": [] for i in range(n_eps)}
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    try:
        urls = [await anyio.to_thread.run_sync(sp.start) for sp in procs]
        async with SGLangClient(urls, max_retries=4, backoff_s=0.1, pool=PoolConfig(probe_every_s=0.5)) as c:
            killed: dict[str, str] = {}
            at_turn, was_killed = anyio.Event(), anyio.Event()
            waiting: list[str] = []

            async def episode(ep: str) -> None:
                ids, covered = [5 + int(ep[2:]), 17, 300, 41], 0
                for k in range(n_turns):
                    if k == kill_after:  # every episode has had its first turns on its own sampler
                        waiting.append(ep)
                        if len(waiting) == n_eps:
                            at_turn.set()
                        await was_killed.wait()
                    g = await c.generate(ids, params, routed_experts_start_len=covered, rid=f"{ep}/{k}")
                    assert g.routing_start <= covered, "routes start at or before the first uncovered position"
                    assert g.routing.shape[0] == len(ids) + len(g.output_ids) - 1 - g.routing_start
                    turns[ep].append((k, g.extra["url"], g.routing_start, covered))
                    covered = len(ids) + len(g.output_ids) - 1
                    ids = ids + g.output_ids.tolist() + [7, 8, 9]

            async def killer() -> None:
                await at_turn.wait()
                victim = c.pool.pins["ep0"]
                sp = procs[urls.index(victim)]
                os.kill(sp.proc.pid, signal.SIGKILL)
                sp.proc.wait()
                killed["url"] = victim
                was_killed.set()

            with anyio.fail_after(240):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(c.monitor)
                    tg.start_soon(killer)
                    async with anyio.create_task_group() as eps:
                        for ep in turns:
                            eps.start_soon(episode, ep)
                    dead, alive_url = killed["url"], next(u for u in urls if u != killed["url"])
                    assert c.pool.live == {alive_url}
                    # it comes back on its port, healthy, but at version 0 while the survivor serves version 1
                    async with SGLangClient(alive_url) as one:
                        await one.update_weights_from_disk(str(default_model_dir()), 1)
                    i = urls.index(dead)
                    procs[i] = SamplerProcess(port=ports[i], log_path=tmp_path / f"s{i}-again.log")
                    with capture_logs() as logs:  # the monitor's verdict on it, once a probe has found it healthy
                        await anyio.to_thread.run_sync(procs[i].start)
                        with anyio.fail_after(30):  # probes every 0.5 s
                            while not (waits := [e for e in logs if e["event"] == "sampler.waiting_for_weights"]):
                                await anyio.sleep(0.05)
                    assert (waits[0]["url"], waits[0]["policy_version"], waits[0]["current"]) == (dead, 0, 1)
                    assert dead not in c.pool.live, "not back before it has the current weights"
                    async with SGLangClient(dead) as one:  # the learner's next push reaches it too
                        await one.update_weights_from_disk(str(default_model_dir()), 1)
                    while dead not in c.pool.live:
                        await anyio.sleep(0.1)
                    tg.cancel_scope.cancel()
    finally:
        for sp in procs:
            sp.stop()
    for ep, ts in turns.items():
        assert [k for k, *_ in ts] == list(range(n_turns)), f"{ep} lost a turn"
        before = {u for k, u, *_ in ts if k < kill_after}
        assert len(before) == 1, "pinned: every turn on one sampler while it lived"
    moved = [ts for ts in turns.values() if ts[0][1] == dead]
    assert moved and c.pool.moved >= len(moved)
    for ts in moved:
        k, url, start, covered = next(t for t in ts if t[1] != dead)
        assert k >= kill_after and start == 0 < covered, "the new sampler recomputed the prefix: routes from 0"
    assert np.all([u == alive_url for ts in moved for k, u, *_ in ts if k >= kill_after])


async def test_a_push_skips_a_dead_sampler_only_while_another_took_the_weights():
    import httpx

    from t1async.protocol.errors import SamplerError

    down = {"b"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})

    async with SGLangClient(["http://a", "http://b"], transport=httpx.MockTransport(handler), max_retries=0) as c:
        assert await c.update_weights_from_disk("/w", 2) == [
            {"success": True, "message": "ok", "num_paused_requests": 0}
        ]
        down.add("a")
        with pytest.raises(SamplerError, match=r"2 of 2 samplers"):
            await c.update_weights_from_disk("/w", 3)


@pytest.mark.slow
async def test_cluster_up_with_two_samplers_trains_through_a_sampler_kill(tmp_path, repo_env):
    import subprocess

    from t1async.cluster.state import ClusterState, is_ours
    from t1async.protocol import wire
    from t1async.transport import NatsConfig, NatsTransport
    from t1async.transport.auth import Role, creds_path

    run_dir = tmp_path / "run"
    argv = [
        *up_argv(run_dir),
        "--samplers",
        "2",
        *SMALL,
        "--duration",
        "400",
        "--plain",
    ]
    out = open(tmp_path / "up.out", "w")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=repo_env, start_new_session=True)
    try:
        st = await wait_running(run_dir, proc)
        assert {"sampler-0", "sampler-1"} <= st.components.keys()
        async with (
            NatsTransport(config=NatsConfig(url=st.nats_url, creds=creds_path(run_dir, Role.READER))) as t,
            t.subscribe("t1.>") as msgs,
        ):
            turns: dict[str, dict[int, wire.TurnRecord]] = {}
            victim = None
            with anyio.fail_after(300):
                async for m in msgs:
                    r = m.record
                    if isinstance(r, wire.TurnRecord):
                        turns.setdefault(r.episode, {})[r.turn] = r  # a retried publish is seen twice here
                    if isinstance(r, wire.PolicyRecord) and r.policy_version >= 2 and victim is None:
                        victim = ClusterState.load(run_dir).components["sampler-0"]
                        os.kill(victim.pid, signal.SIGKILL)
                        killed_at = r.policy_version
                    if isinstance(r, wire.PolicyRecord) and victim is not None and r.policy_version >= killed_at + 3:
                        break  # training went on
            back = ClusterState.load(run_dir).components["sampler-0"]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        stop_cluster(proc, run_dir, 60)
        out.close()
    log = (tmp_path / "up.out").read_text()
    assert proc.returncode == 0, log[-3000:]
    assert back.pid != victim.pid, "the supervisor restarted the killed sampler"
    assert not is_ours(back)
    for ep in turns.values():
        check_episode_turns(list(ep.values()))
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("actor-*.log"))
    assert "sampler.down" in logs, "an actor took the dead sampler out"


@pytest.mark.slow
def test_bench_sampler_samplers_reports_cache_ratio_and_throughput_per_n():
    r, stdout = bench(
        "--samplers",
        "1,2",
        "--num-prompts",
        "4",
        "--multi-turn",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "8",
        timeout=300,
    )
    assert [(x["samplers"], x["pinned"]) for x in r["runs"]] == [(1, True), (2, True), (2, False)]
    for x in r["runs"]:
        assert sum(x["turns_per_sampler"]) == x["turns"] == 12 and 0 < x["cached_ratio"] <= 1
        assert x["output_throughput"] > 0
    assert r["runs"][1]["turns_per_sampler"] == [6, 6], "4 pinned sessions spread 2 + 2 over idle samplers"
    assert "cached_ratio" in stdout
